// "Connect your agent": a Copy button on each snippet (shown only where the clipboard can be written).
(function () {
  "use strict";
  function ready() {
    if (!navigator.clipboard) return;
    document.querySelectorAll("button.connect-copy[data-copy]").forEach(function (button) {
      var pre = document.getElementById(button.getAttribute("data-copy"));
      if (!pre) return;
      button.hidden = false;
      button.addEventListener("click", function () {
        navigator.clipboard.writeText(pre.textContent).then(function () {
          button.textContent = "Copied";
          setTimeout(function () { button.textContent = "Copy"; }, 1500);
        }, function () {
          button.textContent = "Select and copy";
        });
      });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", ready);
  else ready();
})();
