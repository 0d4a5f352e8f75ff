// Draws the datasheet's charts. The figures are computed by the server (autotune_server/pages.py)
// and arrive as JSON data, never as script source: this file only hands them to Plotly.
"use strict";
(function () {
  var block = document.getElementById("chart-data");
  if (!block || typeof Plotly === "undefined") {
    return;
  }
  var figures = JSON.parse(block.textContent);
  var drawn = Object.keys(figures).map(function (id) {
    var element = document.getElementById(id);
    if (!element) {
      return Promise.resolve();
    }
    var figure = figures[id];
    return Plotly.newPlot(element, figure.data, figure.layout, figure.config);
  });
  // Lets tests (and anyone scripting the page) wait for the charts instead of guessing a delay.
  Promise.all(drawn).then(function () {
    document.body.setAttribute("data-charts", "ready");
  });
})();
