// artweb dashboard: small progressive enhancements over server-rendered pages.
// Pages work without this file except for charts, live grader validation, "try it" and the
// playground, which need the browser to call JSON endpoints.
(function () {
  "use strict";
  const body = document.body;
  const csrf = body.dataset.csrf;
  const team = body.dataset.team;

  function jsonHeaders() {
    const headers = { "Content-Type": "application/json", "X-CSRFToken": csrf };
    if (team) headers["X-Team"] = team;
    return headers;
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Confirmation before destructive posts (works for forms swapped in by htmx too).
  document.addEventListener("submit", function (event) {
    const message = event.target.dataset && event.target.dataset.confirm;
    if (message && !window.confirm(message)) event.preventDefault();
  });

  // Copy buttons.
  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const source = document.getElementById(button.dataset.copy);
    const text = source.textContent;
    const done = function () { button.textContent = "Copied"; setTimeout(function () { button.textContent = "Copy"; }, 1500); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { selectText(source); });
    } else {
      selectText(source);
      button.textContent = "Selected: press Ctrl+C";
    }
  });

  function selectText(node) {
    const range = document.createRange();
    range.selectNodeContents(node);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  // --- run page charts ------------------------------------------------------------------------
  const charts = {};
  let chartedStep = null;

  // Tick labels with as many decimals as the tick spacing needs (tiny ranges stay readable).
  function formatTick(value, index, ticks) {
    const v = Number(value);
    if (v === 0) return "0";
    if (Math.abs(v) < 1e-3) return v.toExponential(1);
    const spacing = ticks.length > 1 ? Math.abs(ticks[1].value - ticks[0].value) : Math.abs(v);
    const decimals = spacing > 0 ? Math.max(0, Math.min(6, Math.ceil(-Math.log10(spacing)))) : 2;
    return v.toFixed(decimals);
  }

  function lineChart(id, datasets, steps) {
    const canvas = document.getElementById(id);
    if (!canvas) return;
    if (charts[id]) {
      charts[id].data.labels = steps;
      charts[id].data.datasets.forEach(function (dataset, i) { dataset.data = datasets[i].data; });
      charts[id].update("none");
      return;
    }
    charts[id] = new window.Chart(canvas, {
      type: "line",
      data: { labels: steps, datasets: datasets },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        spanGaps: true,
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { display: datasets.length > 1, labels: { filter: function (item) { return !item.text.startsWith("_"); } } } },
        scales: { x: { title: { display: true, text: "step" } }, y: { ticks: { callback: formatTick } } },
      },
    });
  }

  function drawCharts(data) {
    const empty = document.getElementById("charts-empty");
    if (empty) empty.hidden = data.steps.length > 0;
    const mean = data.reward_mean;
    const upper = mean.map(function (m, i) { return m === null ? null : m + (data.reward_std[i] || 0); });
    const lower = mean.map(function (m, i) { return m === null ? null : m - (data.reward_std[i] || 0); });
    lineChart("chart-reward", [
      { label: "_upper", data: upper, borderWidth: 0, pointRadius: 0, backgroundColor: "rgba(37,99,235,0.15)", fill: "+1" },
      { label: "_lower", data: lower, borderWidth: 0, pointRadius: 0, fill: false },
      { label: "mean reward", data: mean, borderColor: "#2563eb", backgroundColor: "#2563eb", pointRadius: 3 },
    ], data.steps);
    for (const [key, series] of Object.entries(data.series)) {
      lineChart("chart-" + key, [{ label: series.label, data: series.values, borderColor: "#0f766e", backgroundColor: "#0f766e", pointRadius: 3 }], data.steps);
    }
  }

  function refreshCharts() {
    const container = document.getElementById("charts");
    const live = document.getElementById("run-live-inner");
    if (!container || !window.Chart) return;
    const step = live ? live.dataset.step + ":" + live.dataset.status : "";
    if (step === chartedStep) return;
    chartedStep = step;
    fetch(container.dataset.metricsUrl, { headers: { Accept: "application/json" } })
      .then(function (response) { return response.json(); })
      .then(drawCharts);
  }

  window.addEventListener("load", refreshCharts);
  document.addEventListener("htmx:afterSettle", refreshCharts);

  // --- reward editor: validation as you type, and "try it" -----------------------------------
  function specOf(form) {
    return form.querySelector("textarea[name=spec]").value;
  }

  function showProblems(target, problems) {
    target.replaceChildren();
    target.className = "validation invalid";
    const list = el("ul");
    for (const problem of problems) list.append(el("li", {}, problem));
    target.append(list);
  }

  function validate(form) {
    const target = form.querySelector("[data-validation]");
    let spec;
    try {
      spec = JSON.parse(specOf(form));
    } catch (error) {
      showProblems(target, ["Not valid JSON: " + error.message]);
      return;
    }
    fetch(form.dataset.validateUrl, { method: "POST", headers: jsonHeaders(), body: JSON.stringify({ grader: spec }) })
      .then(function (response) { return response.json(); })
      .then(function (answer) {
        if (answer.valid) {
          target.className = "validation valid";
          target.textContent = "✓ Valid " + answer.grader.type + " grader";
        } else {
          showProblems(target, answer.problems);
        }
      });
  }

  document.querySelectorAll("form[data-grader-editor]").forEach(function (form) {
    if (body.dataset.role === "viewer") return;
    let timer = null;
    form.querySelector("textarea[name=spec]").addEventListener("input", function () {
      clearTimeout(timer);
      timer = setTimeout(function () { validate(form); }, 350);
    });
    validate(form);
  });

  const tryIt = document.getElementById("try-it");
  if (tryIt) {
    tryIt.addEventListener("submit", function (event) {
      event.preventDefault();
      const result = document.getElementById("try-result");
      result.replaceChildren(el("p", { class: "muted" }, "Grading…"));
      let grader, item, tools;
      try {
        grader = JSON.parse(specOf(document.querySelector("form[data-grader-editor]")));
        item = JSON.parse(document.getElementById("try-item").value || "{}");
        tools = JSON.parse(document.getElementById("try-tools").value.trim() || "null");
      } catch (error) {
        result.replaceChildren(el("p", { class: "error" }, "Not valid JSON: " + error.message));
        return;
      }
      const text = document.getElementById("try-sample").value;
      const sample = Array.isArray(tools) ? { output_text: text, output_tools: tools } : text;
      const payload = { grader: grader, model_sample: sample, item: item };
      const editor = document.querySelector("form[data-grader-editor]");
      // Check the spec first (always a 200 answer), so a spec with problems is reported here
      // instead of as a failed request to the dry-run endpoint.
      fetch(editor.dataset.validateUrl, { method: "POST", headers: jsonHeaders(), body: JSON.stringify({ grader: grader }) })
        .then(function (response) { return response.json(); })
        .then(function (answer) {
          if (!answer.valid) return [false, { error: { message: "Fix the spec first: " + answer.problems.join("; ") } }];
          return fetch(tryIt.dataset.runUrl, { method: "POST", headers: jsonHeaders(), body: JSON.stringify(payload) })
            .then(function (response) { return response.json().then(function (body) { return [response.ok, body]; }); });
        })
        .then(function ([ok, body]) {
          result.replaceChildren();
          if (!ok) {
            result.append(el("p", { class: "error" }, body.error.message));
            return;
          }
          result.append(el("p", { class: "reward-value" }, "Reward " + Number(body.reward).toFixed(3)));
          const subs = Object.entries(body.sub_rewards || {});
          if (subs.length) {
            const table = el("table", { class: "sub-rewards" });
            for (const [name, value] of subs) {
              const row = el("tr");
              row.append(el("th", { scope: "row" }, name), el("td", {}, Number(value).toFixed(3)));
              table.append(row);
            }
            result.append(table);
          }
          const errors = (body.metadata && body.metadata.error_details) || [];
          if (errors.length) {
            const list = el("ul", { class: "grader-errors" });
            for (const error of errors) list.append(el("li", {}, (error.code || "error") + (error.grader ? " in " + error.grader : "") + ": " + (error.detail || "")));
            result.append(list);
          } else {
            result.append(el("p", { class: "muted" }, "No grader errors."));
          }
        });
    });
  }

  // --- checkpoint playground: the same prompt to the checkpoint and its base model, streamed ----
  async function streamInto(url, payload, target) {
    target.textContent = "";
    target.classList.remove("error");
    target.classList.add("streaming");
    try {
      const response = await fetch(url, { method: "POST", headers: jsonHeaders(), body: JSON.stringify(payload) });
      if (!response.ok) {
        const bodyJson = await response.json().catch(function () { return {}; });
        target.classList.add("error");
        target.textContent = (bodyJson.error && bodyJson.error.message) || ("HTTP " + response.status);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) {
              target.classList.add("error");
              target.textContent += "\n" + chunk.error.message;
              continue;
            }
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) target.textContent += delta.content;
          }
        }
      }
    } catch (error) {
      target.classList.add("error");
      target.textContent = "The request failed: " + error.message;
    } finally {
      target.classList.remove("streaming");
      target.dataset.done = "1";
    }
  }

  const playground = document.getElementById("playground");
  if (playground) {
    document.getElementById("playground-form").addEventListener("submit", function (event) {
      event.preventDefault();
      const messages = [];
      const system = document.getElementById("pg-system").value.trim();
      if (system) messages.push({ role: "system", content: system });
      messages.push({ role: "user", content: document.getElementById("pg-prompt").value });
      const common = {
        messages: messages,
        stream: true,
        max_tokens: Number(document.getElementById("pg-max-tokens").value) || 64,
        temperature: Number(document.getElementById("pg-temperature").value),
      };
      const url = playground.dataset.url;
      const answers = [
        [playground.dataset.model, document.getElementById("pg-answer-checkpoint")],
        [playground.dataset.base, document.getElementById("pg-answer-base")],
      ];
      answers.forEach(function ([model, target]) { delete target.dataset.done; });
      answers.forEach(function ([model, target]) { streamInto(url, Object.assign({ model: model }, common), target); });
    });
  }
})();
