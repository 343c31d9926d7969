// Flywheel UI behaviour (no inline script: the CSP forbids it).
// Keyboard: elements carrying data-key="x" are clicked (links, buttons, <summary>) or focused (fields)
// when x is pressed; the list page adds j/k row selection. "?" toggles the key help.
(function () {
  "use strict";

  function isField(el) {
    return el && (el.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(el.tagName));
  }

  function visible(el) {
    return el && el.offsetParent !== null;
  }

  function toggleHelp() {
    var help = document.getElementById("keyhelp");
    if (!help) return;
    if (help.open) help.close(); else help.showModal();
  }

  // --- list page: a selected row that j/k move ---------------------------------------------------------
  function rows() {
    return Array.prototype.slice.call(document.querySelectorAll("#rows tr.row"));
  }

  function selectedIndex(all) {
    for (var i = 0; i < all.length; i++) if (all[i].classList.contains("selected")) return i;
    return -1;
  }

  function select(all, i) {
    if (!all.length) return;
    i = Math.max(0, Math.min(all.length - 1, i));
    all.forEach(function (r) { r.classList.remove("selected"); r.removeAttribute("aria-selected"); });
    all[i].classList.add("selected");
    all[i].setAttribute("aria-selected", "true");
    all[i].scrollIntoView({ block: "nearest" });
  }

  function listKey(key) {
    var all = rows();
    if (!all.length) return false;
    var i = selectedIndex(all);
    if (key === "j") { select(all, i + 1); return true; }
    if (key === "k") { select(all, i < 0 ? 0 : i - 1); return true; }
    if ((key === "Enter" || key === "o") && i >= 0) { window.location.assign(all[i].dataset.href); return true; }
    return false;
  }

  function keyTarget(key) {
    var els = document.querySelectorAll('[data-key="' + CSS.escape(key) + '"]');
    for (var i = 0; i < els.length; i++) if (visible(els[i])) return els[i];
    return null;
  }

  document.addEventListener("keydown", function (e) {
    if (e.metaKey || e.ctrlKey || e.altKey) return;
    var help = document.getElementById("keyhelp");
    if (isField(e.target)) {
      if (e.key === "Escape") e.target.blur();
      return;
    }
    if (e.key === "?") { e.preventDefault(); toggleHelp(); return; }
    if (help && help.open) return;
    if (document.querySelector("[data-page=list]") && listKey(e.key)) { e.preventDefault(); return; }
    var el = keyTarget(e.key);
    if (!el) return;
    e.preventDefault();
    if (isField(el)) { el.focus(); el.select && el.select(); return; }
    if (el.tagName === "SUMMARY") {
      // Open the <details> (never close it from the keyboard) and put the cursor in its field.
      el.parentElement.open = true;
      var field = el.parentElement.querySelector("textarea, input:not([type=hidden])");
      if (field) field.focus();
      return;
    }
    el.click();
  });

  document.addEventListener("click", function (e) {
    if (e.target.closest("[data-help-toggle]")) { toggleHelp(); return; }
    // A click anywhere on a list row opens it, like its title link.
    var row = e.target.closest("#rows tr.row");
    if (row && !e.target.closest("a, button, input")) window.location.assign(row.dataset.href);
  });

  // --- htmx -------------------------------------------------------------------------------------------
  function toast(text) {
    var el = document.getElementById("toast");
    if (!el) { window.alert(text); return; }
    el.textContent = text;
    el.hidden = false;
    clearTimeout(el._timer);
    el._timer = setTimeout(function () { el.hidden = true; }, 5000);
  }

  // 422 carries a form with its error message: swap it in like a success.
  document.addEventListener("htmx:beforeSwap", function (e) {
    if (e.detail.xhr.status === 422) { e.detail.shouldSwap = true; e.detail.isError = false; }
  });

  document.addEventListener("htmx:responseError", function (e) {
    var status = e.detail.xhr.status;
    if (status === 403) toast("You need the reviewer role in this project to change that.");
    else if (status === 404) toast("Not found: it may have been deleted.");
    else toast("The server answered " + status + "; nothing was changed.");
  });

  document.addEventListener("htmx:sendError", function () {
    toast("Could not reach the server; nothing was changed.");
  });

  // An outcome tab submits the filter form with its outcome, so that it carries what the form holds now: the
  // tab's own link was rendered with the filters of its time, which a request still in flight may have
  // changed. The form's requests replace one another (hx-sync), so the last one asked for is the one shown.
  document.addEventListener("click", function (e) {
    var tab = e.target.closest && e.target.closest("a[data-tab-outcome]");
    var form = document.getElementById("filters");
    var field = document.getElementById("f-outcome");
    if (!tab || !form || !field || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey) return;
    e.preventDefault();
    field.value = tab.dataset.tabOutcome;
    form.requestSubmit();
  });

  // A slow action says it is under way: the button that submitted a plain (non-htmx) form and carries
  // data-busy="Running checks…" shows that text, the form is marked busy, and a second click sends nothing
  // (the button is not disabled: a disabled submitter would drop its name and value from the request).
  document.addEventListener("submit", function (e) {
    var form = e.target;
    var button = e.submitter;
    if (!button || !button.dataset || !button.dataset.busy || form.hasAttribute("hx-post")) return;
    if (form.getAttribute("aria-busy") === "true") { e.preventDefault(); return; }
    form.setAttribute("aria-busy", "true");
    button.classList.add("busy");
    button.textContent = button.dataset.busy;
    // A page restored from the back/forward cache is no longer busy.
    window.addEventListener("pageshow", function () { form.removeAttribute("aria-busy"); }, { once: true });
  });

  // The outcome tabs live in the swapped results: keep the form's hidden outcome field in step.
  document.addEventListener("htmx:afterSwap", function (e) {
    var inner = e.detail.target && e.detail.target.querySelector(".results-inner");
    var field = document.getElementById("f-outcome");
    if (inner && field) field.value = inner.dataset.outcome || "";
  });
})();
