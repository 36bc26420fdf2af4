// Draw every <div class="plot" data-plotly="..."> with the figure JSON rendered by the server
// (federation/dashboard/plots.py). plotly.js is served from static/vendor/.
(function () {
  "use strict";
  function draw() {
    document.querySelectorAll("div.plot[data-plotly]").forEach(function (el) {
      var fig = JSON.parse(el.getAttribute("data-plotly"));
      window.Plotly.newPlot(el, fig.data || [], fig.layout || {}, {
        responsive: true,
        displaylogo: false,
        modeBarButtonsToRemove: ["select2d", "lasso2d"],
      }).then(function () { el.setAttribute("data-rendered", "true"); });
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
