/* A live check's looks: the always-valid p-values of the failure and unsafe-action rules against the canary's
   (or the new production's) trajectories, on a log scale, with the line a rule crosses to call it worse. Drawn
   with uPlot (served from static/vendor/uplot) from the data the page embeds (json_script). */
(function () {
  "use strict";

  function draw(box, data) {
    box.textContent = "";
    if (data.n.length < 2) {
      box.textContent = "The chart needs two looks that saw traffic.";
      box.classList.add("muted");
      return null;
    }
    box.classList.remove("muted");
    // A p-value of exactly 0 has no place on a log scale: shown at the axis' floor.
    function floor(values) { return values.map(function (p) { return Math.max(Number(p), 1e-12); }); }
    return new uPlot({
      title: "Always-valid p-values by the look", width: Math.max(280, box.clientWidth || 600), height: 220,
      scales: { x: { time: false }, y: { distr: 3, range: [1e-6, 1] } },
      axes: [{ label: data.x_label }, {
        label: "p",
        values: function (u, ticks) {
          return ticks.map(function (v) {
            if (v === null || v === undefined) return "";
            return v >= 0.01 ? String(v) : v.toExponential(0);
          });
        },
      }],
      series: [
        { label: data.x_label },
        { label: "failures", stroke: "#2f5fd0", width: 2, points: { show: data.n.length < 40 } },
        { label: "unsafe actions", stroke: "#d9480f", width: 2, points: { show: data.n.length < 40 } },
        { label: "worse below", stroke: "#8b949e", width: 1, dash: [6, 4], points: { show: false } },
      ],
    }, [data.n, floor(data.failure_p), floor(data.unsafe_p), data.n.map(function () { return data.alpha; })], box);
  }

  function start() {
    var source = document.getElementById("live-check-trail");
    var box = document.querySelector(".live-chart");
    if (!source || !box || typeof uPlot === "undefined") return;
    var data = JSON.parse(source.textContent);
    var plot = draw(box, data);
    var resizing = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizing);
      resizing = setTimeout(function () {
        if (plot) plot.setSize({ width: Math.max(280, box.clientWidth || 600), height: 220 });
      }, 150);
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
