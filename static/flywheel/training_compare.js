/* Jobs compared: each job's holdout success by step on one uPlot chart (served from static/vendor/uplot), from
   the data the page embeds (json_script), with production's success before training as a dashed line. */
(function () {
  "use strict";

  var COLOURS = ["#2f5fd0", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#0b7285", "#e67700", "#5c940d",
                 "#364fc7", "#a61e4d"];

  function aligned(curves) {
    // uPlot takes one x array for every series: the union of the jobs' steps, a gap where a job has no point.
    var steps = {};
    curves.forEach(function (c) { c.step.forEach(function (s) { steps[s] = true; }); });
    var xs = Object.keys(steps).map(Number).sort(function (a, b) { return a - b; });
    var columns = [xs];
    curves.forEach(function (c) {
      var at = {};
      c.step.forEach(function (s, i) { at[s] = c.success_rate[i]; });
      columns.push(xs.map(function (s) { return at[s] === undefined || at[s] === null ? null : Number(at[s]); }));
    });
    return columns;
  }

  function draw(box, data) {
    var curves = data.curves;
    var columns = aligned(curves);
    box.textContent = "";
    if (!columns[0].length) {
      box.textContent = "No holdout evaluation yet in these jobs.";
      box.classList.add("muted");
      return null;
    }
    var series = [{ label: "step" }];
    curves.forEach(function (c, i) {
      series.push({ label: "job " + c.job, stroke: COLOURS[i % COLOURS.length], width: 2, spanGaps: true,
                    points: { show: columns[0].length < 40 } });
    });
    var baselines = curves.map(function (c) { return c.production_success; });
    var same = baselines.every(function (b) { return b !== null && b !== undefined && b === baselines[0]; });
    if (same) {
      series.push({ label: "production before training", stroke: "#8b949e", width: 1, dash: [6, 4],
                    points: { show: false } });
      columns.push(columns[0].map(function () { return Number(baselines[0]); }));
    }
    return new uPlot({
      title: box.getAttribute("data-title"), width: Math.max(280, box.clientWidth || 600), height: 260,
      scales: { x: { time: false } }, axes: [{ label: "step" }, { label: "success" }], series: series,
    }, columns, box);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var source = document.getElementById("compare-curves-data");
    var box = document.querySelector(".compare-chart");
    if (!source || !box || !window.uPlot) return;
    var data = JSON.parse(source.textContent);
    var plot = draw(box, data);
    var resizing = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizing);
      resizing = setTimeout(function () { if (plot) plot.setSize({ width: Math.max(280, box.clientWidth), height: 260 }); }, 150);
    });
  });
})();
