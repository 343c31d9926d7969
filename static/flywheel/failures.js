// Failure modes: bulk selection on the trajectory list (shift-click ranges, "all matching"), and the review
// queue's message cursor (j/k). Number keys, Enter, s, u, n and e are data-key buttons that app.js presses.
(function () {
  "use strict";

  // --- bulk selection on the list ----------------------------------------------------------------------
  var lastBox = null; // the checkbox last clicked: a shift-click ticks everything between it and the new one

  function boxes() {
    return Array.prototype.slice.call(document.querySelectorAll('#rows input[type=checkbox][name=ids]'));
  }

  function updateCount() {
    var count = document.querySelector("[data-bulk-count]");
    if (!count) return;
    var all = document.querySelector("[data-bulk-all]");
    var n = boxes().filter(function (b) { return b.checked; }).length;
    count.textContent = all && all.checked ? "all matching" : n + " selected";
    boxes().forEach(function (b) { b.closest("tr").classList.toggle("ticked", b.checked); });
  }

  document.addEventListener("click", function (e) {
    var cell = e.target.closest && e.target.closest("#rows td.c-check");
    if (!cell) return;
    // The rest of a row opens the trajectory (app.js); a click in the tick column only ticks.
    e.stopPropagation();
    var box = cell.querySelector("input[type=checkbox]");
    if (e.target !== box) { box.checked = !box.checked; }
    if (e.shiftKey && lastBox && lastBox !== box && document.body.contains(lastBox)) {
      var all = boxes();
      var a = all.indexOf(lastBox), b = all.indexOf(box);
      if (a >= 0 && b >= 0) {
        for (var i = Math.min(a, b); i <= Math.max(a, b); i++) all[i].checked = box.checked;
      }
    }
    lastBox = box;
    updateCount();
  }, true);

  document.addEventListener("change", function (e) {
    if (e.target.matches && e.target.matches("[data-check-page]")) {
      boxes().forEach(function (b) { b.checked = e.target.checked; });
    }
    if (e.target.matches && e.target.matches("[data-check-page], [data-bulk-all], #rows input[name=ids]")) updateCount();
  });

  document.addEventListener("htmx:afterSwap", function () { lastBox = null; updateCount(); });

  // --- the review queue: j/k move a cursor over the messages ---------------------------------------------
  function queuePage() { return document.querySelector("[data-page=queue][data-selected]"); }

  function messages() {
    return Array.prototype.slice.call(document.querySelectorAll(".conversation article.msg"));
  }

  function selectMessage(index, scroll) {
    var all = messages();
    if (!all.length) return;
    index = Math.max(0, Math.min(all.length - 1, index));
    all.forEach(function (m) { m.classList.remove("current"); m.removeAttribute("aria-current"); });
    var m = all[index];
    m.classList.add("current");
    m.setAttribute("aria-current", "true");
    if (scroll) m.scrollIntoView({ block: "nearest" });
    var number = m.id.replace(/^m/, "");
    document.querySelectorAll("[data-message-index]").forEach(function (f) { f.value = number; });
    var promote = document.querySelector("[data-promote]");
    if (promote) {
      var url = new URL(promote.href);
      url.searchParams.set("message", number);
      promote.href = url.toString();
    }
    var at = document.querySelector("[data-at]");
    if (at) at.textContent = "message #" + number;
    queuePage().dataset.selected = number;
  }

  function currentIndex() {
    var all = messages();
    for (var i = 0; i < all.length; i++) if (all[i].classList.contains("current")) return i;
    return -1;
  }

  function isField(el) {
    return el && (el.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(el.tagName));
  }

  document.addEventListener("keydown", function (e) {
    var page = queuePage();
    if (!page || e.metaKey || e.ctrlKey || e.altKey || isField(e.target)) return;
    var help = document.getElementById("keyhelp");
    if (help && help.open) return;
    if (e.key !== "j" && e.key !== "k") return;
    e.preventDefault();
    var i = currentIndex();
    selectMessage(e.key === "j" ? i + 1 : (i < 0 ? 0 : i - 1), true);
  });

  function init() {
    var page = queuePage();
    if (page && page.dataset.selected !== "") {
      var all = messages();
      var wanted = document.getElementById("m" + page.dataset.selected);
      if (wanted) selectMessage(all.indexOf(wanted), true);
    }
    updateCount();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
