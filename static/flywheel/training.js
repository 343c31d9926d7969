/* A training job's live curves: train reward, holdout success, KL and completion length, drawn with uPlot
   (served from static/vendor/uplot) from the job's curves endpoint, polled while the job is active. */
(function () {
  "use strict";

  function series(data, name) {
    if (name === "holdout") return [data.holdout.step, data.holdout.success_rate];
    return [data.train.step, data.train[name]];
  }

  function draw(box, xs, ys, title, old) {
    if (old) old.destroy();
    box.textContent = "";
    if (!xs.length) {
      box.textContent = title + ": no points yet.";
      box.classList.add("muted");
      return null;
    }
    box.classList.remove("muted");
    var width = Math.max(240, box.clientWidth || 320);
    return new uPlot({
      title: title, width: width, height: 180,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, {}],
      series: [{ label: "step" }, { label: title, stroke: "#2f5fd0", width: 2, points: { show: xs.length < 40 } }],
    }, [xs, ys.map(function (v) { return v === null || v === undefined ? null : Number(v); })], box);
  }

  function start(root) {
    var url = root.getAttribute("data-curves-url");
    var boxes = Array.prototype.slice.call(root.querySelectorAll(".job-chart"));
    var plots = {};
    var live = root.getAttribute("data-live") === "1";

    function load() {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
        .then(function (data) {
          boxes.forEach(function (box) {
            var name = box.getAttribute("data-series");
            var pair = series(data, name);
            plots[name] = draw(box, pair[0], pair[1], box.getAttribute("data-title"), plots[name]);
          });
          live = ["evaluating", "queued", "running"].indexOf(data.status) >= 0;
          if (live) setTimeout(load, 3000);
        })
        .catch(function () { if (live) setTimeout(load, 10000); });
    }
    load();
  }

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.querySelector(".job-charts");
    if (root && window.uPlot) start(root);
  });
})();
