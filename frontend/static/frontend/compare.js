// The compare page's charts: one line per run on a shared linear step axis, drawn from the
// series the page embeds (compare-data, built by frontend/compare_pages.py). A null value is a
// step the run did not measure: a gap, as on the run page.
(function () {
  "use strict";
  const PALETTE = ["#2563eb", "#db2777", "#16a34a", "#ea580c", "#7c3aed"];

  function draw() {
    const source = document.getElementById("compare-data");
    if (!source || !window.Chart) return;
    JSON.parse(source.textContent).forEach(function (chart) {
      const canvas = document.getElementById("chart-" + chart.key);
      if (!canvas || canvas.hidden) return;
      const datasets = chart.datasets.map(function (dataset, i) {
        const color = PALETTE[i % PALETTE.length];
        // Evaluations are points, not joined (as on the run page): two of them are not a trend.
        const points = chart.key === "validation";
        return { label: dataset.label, data: dataset.points, borderColor: color, backgroundColor: color, pointRadius: points ? 5 : 3, showLine: !points };
      });
      new window.Chart(canvas, {
        type: "line",
        data: { datasets: datasets },
        options: {
          responsive: true,
          maintainAspectRatio: false,
          animation: false,
          spanGaps: false,
          interaction: { mode: "nearest", intersect: false },
          plugins: { legend: { display: true } },
          scales: { x: { type: "linear", title: { display: true, text: "step" }, ticks: { precision: 0 } } },
        },
      });
    });
  }

  window.addEventListener("load", draw);
})();
