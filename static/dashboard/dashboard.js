// Draw every <div class="plot" data-plotly="..."> with the figure JSON rendered by the server
// (federation/dashboard/plots.py). plotly.js is served from static/vendor/.
// The div is a figure named and described (its data in words) for a screen reader, which would
// otherwise read the drawing's scattered tick and legend texts: the drawn SVGs are hidden from it
// (the mode bar's buttons stay reachable).
(function () {
  "use strict";
  function hideDrawing(el) {
    el.querySelectorAll("svg.main-svg").forEach(function (svg) {
      svg.setAttribute("aria-hidden", "true");
    });
  }
  function draw() {
    document.querySelectorAll("div.plot[data-plotly]").forEach(function (el) {
      var fig = JSON.parse(el.getAttribute("data-plotly"));
      window.Plotly.newPlot(el, fig.data || [], fig.layout || {}, {
        responsive: true,
        displaylogo: false,
        modeBarButtonsToRemove: ["select2d", "lasso2d"],
      }).then(function () {
        hideDrawing(el);
        el.setAttribute("data-rendered", "true");
      });
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
