/* Live traffic per version: small uPlot series (failure rate and trajectories per hour, or per day) on the
   Models page, larger ones on a version's page, from the data the page embeds (json_script). uPlot is served
   from static/vendor/uplot. An hour without traffic has no failure rate: a gap, not a zero. */
(function () {
  "use strict";

  var STYLE = {
    failure_rate: { label: "failure rate", stroke: "#c92a2a", fill: "rgba(201,42,42,.12)" },
    trajectories: { label: "trajectories", stroke: "#2f5fd0", fill: "rgba(47,95,208,.12)" },
  };

  function percent(u, values) {
    return values.map(function (v) { return v === null || v === undefined ? "" : Math.round(v * 100) + "%"; });
  }

  function draw(box, series, name) {
    var big = box.classList.contains("lt-big");
    var style = STYLE[name];
    var ys = series[name].map(function (v) { return v === null || v === undefined ? null : Number(v); });
    var width = Math.max(big ? 280 : 160, box.clientWidth || (big ? 600 : 220));
    var height = big ? 220 : 64;
    var yAxis = { size: big ? 50 : 36, font: "10px sans-serif", ticks: { show: false } };
    if (name === "failure_rate") yAxis.values = percent;
    var opts = {
      width: width, height: height, legend: { show: big }, cursor: { show: big, points: { show: big } },
      scales: { x: { time: true }, y: { range: function (u, min, max) { return [0, Math.max(name === "failure_rate" ? 0.05 : 1, max || 0)]; } } },
      axes: [big ? { font: "10px sans-serif" } : { show: false }, yAxis],
      series: [{}, { label: style.label, stroke: style.stroke, fill: style.fill, width: big ? 2 : 1.5,
                     spanGaps: false, points: { show: big && ys.length < 40 } }],
    };
    box.textContent = "";
    return new uPlot(opts, [series.t, ys], box);
  }

  function init(id) {
    var source = document.getElementById(id);
    if (!source || !window.uPlot) return [];
    var data = JSON.parse(source.textContent);
    var byVersion = {};
    data.versions.forEach(function (v) { byVersion[v.version] = v.series; });
    var plots = [];
    document.querySelectorAll(".lt-chart").forEach(function (box) {
      var series = byVersion[box.getAttribute("data-version")];
      if (series) plots.push([box, draw(box, series, box.getAttribute("data-series"))]);
    });
    return plots;
  }

  document.addEventListener("DOMContentLoaded", function () {
    var plots = init("live-series-data").concat(init("live-version-data"));
    var resizing = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizing);
      resizing = setTimeout(function () {
        plots.forEach(function (p) {
          if (p[0].classList.contains("lt-big")) p[1].setSize({ width: Math.max(280, p[0].clientWidth), height: 220 });
        });
      }, 150);
    });
  });
})();
