/* A training job's live curves: train reward, holdout success, KL and completion length, drawn with uPlot
   (served from static/vendor/uplot) from the job's curves endpoint, polled while the job is active. */
(function () {
  "use strict";

  function numbers(values) {
    return values.map(function (v) { return v === null || v === undefined ? null : Number(v); });
  }

  function series(data, name) {
    if (name === "holdout") return [data.holdout.step, data.holdout.success_rate];
    return [data.train.step, data.train[name]];
  }

  function draw(box, xs, ys, title, old, baseline, note) {
    if (old) old.destroy();
    box.textContent = "";
    var measured = ys.some(function (v) { return v !== null && v !== undefined; });
    if (!xs.length || !measured) {
      box.textContent = title + ": " + (xs.length && note ? note : "no points yet.");
      box.classList.add("muted");
      return null;
    }
    box.classList.remove("muted");
    if (baseline !== null && xs[0] > 0) {
      // Production before training is where the job starts (step 0): the axis starts there, and a single
      // evaluation shows above or below a line instead of alone in an axis of its own making.
      xs = [0].concat(xs);
      ys = [null].concat(ys);
    }
    var lines = [{ label: "step" }, { label: title, stroke: "#2f5fd0", width: 2, points: { show: xs.length < 40 } }];
    var columns = [xs, numbers(ys)];
    if (baseline !== null) {
      // Production's holdout success before training: the line the candidate has to clear.
      lines.push({ label: "production", stroke: "#8b949e", width: 1, dash: [6, 4], points: { show: false } });
      columns.push(xs.map(function () { return baseline; }));
    }
    return new uPlot({
      title: title, width: Math.max(240, box.clientWidth || 320), height: 180,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, {}],
      series: lines,
    }, columns, box);
  }

  function start(root) {
    var url = root.getAttribute("data-curves-url");
    var raw = root.getAttribute("data-baseline");
    var baseline = raw === null || raw === "" || isNaN(Number(raw)) ? null : Number(raw);
    var boxes = Array.prototype.slice.call(root.querySelectorAll(".job-chart"));
    var empty = root.querySelector(".job-charts-empty");
    var plots = {};
    var live = root.getAttribute("data-live") === "1";

    function load() {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
        .then(function (data) {
          // Before the trainer's first step there is nothing to draw: one line says so, not four empty charts.
          var nothing = !data.train.step.length && !data.holdout.step.length;
          if (empty) empty.hidden = !nothing;
          boxes.forEach(function (box) {
            var name = box.getAttribute("data-series");
            var pair = series(data, name);
            box.hidden = nothing;
            if (nothing) return;
            plots[name] = draw(box, pair[0], pair[1], box.getAttribute("data-title"), plots[name],
                               name === "holdout" ? baseline : null, box.getAttribute("data-unmeasured"));
          });
          live = ["evaluating", "queued", "running"].indexOf(data.status) >= 0;
          if (live) setTimeout(load, 3000);
        })
        .catch(function () { if (live) setTimeout(load, 10000); });
    }

    var resizing = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizing);
      resizing = setTimeout(function () {
        boxes.forEach(function (box) {
          var plot = plots[box.getAttribute("data-series")];
          if (plot) plot.setSize({ width: Math.max(240, box.clientWidth), height: 180 });
        });
      }, 150);
    });
    load();
  }

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.querySelector(".job-charts");
    if (root && window.uPlot) start(root);
  });
})();
