// Draws every <div class="chart"> from the JSON spec in its data-spec attribute:
// {title, steps: [...], series: {name: [values or null]}} (grpo_trainer/ui/run_view.py RunView.curves).
(function () {
  const colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"];
  for (const el of document.querySelectorAll("div.chart")) {
    const spec = JSON.parse(el.dataset.spec);
    const names = Object.keys(spec.series);
    const opts = {
      title: spec.title, width: el.clientWidth || 420, height: 220,
      scales: {x: {time: false}},
      axes: [{label: "step"}, {}],
      series: [{label: "step"}].concat(names.map((n, i) => ({
        label: n, stroke: colors[i % colors.length], width: 2, spanGaps: true,
        points: {show: spec.steps.length < 60, size: 5}}))),
    };
    new uPlot(opts, [spec.steps].concat(names.map(n => spec.series[n])), el);
    el.dataset.rendered = "1";
  }
})();
