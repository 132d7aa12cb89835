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

  // --- numbers by magnitude (mirrors projects/formatting.py format_number) -------------------
  function scientific(v, digits) {
    const [mantissa, exponent] = v.toExponential(Math.max(digits - 1, 0)).split("e");
    const trimmed = mantissa.indexOf(".") >= 0 ? mantissa.replace(/0+$/, "").replace(/\.$/, "") : mantissa;
    const power = Number(exponent);
    return trimmed + "e" + (power < 0 ? "-" : "+") + Math.abs(power);
  }

  function formatNumber(value, digits) {
    digits = digits || 4;
    if (value === null || value === undefined || typeof value === "boolean") return "–";
    const v = Number(value);
    if (Number.isNaN(v)) return "–";
    if (!Number.isFinite(v)) return String(v);
    if (v === 0) return "0";
    const magnitude = Math.abs(v);
    if (Number.isInteger(v) && magnitude < 1e6) return String(v);
    if (magnitude < 1e-3 || magnitude >= 1e6) return scientific(v, digits);
    const text = String(Number(v.toPrecision(digits)));
    return text.indexOf("e") >= 0 ? v.toFixed(0) : text;
  }
  window.artwebFormatNumber = formatNumber;

  // Tick labels with the fewest significant digits that keep neighbouring ticks apart (a loss
  // that moves by 1e-9 around 1.3e-6 must not read "1.3e-6" five times).
  function formatTick(value, index, ticks) {
    const values = ticks.map(function (tick) { return tick.value; });
    for (let digits = 2; digits <= 10; digits++) {
      const labels = values.map(function (v) { return formatNumber(v, digits); });
      if (new Set(labels).size === labels.length) return labels[index];
    }
    return formatNumber(value, 10);
  }

  // --- run page charts ------------------------------------------------------------------------
  const charts = {};
  let chartedStep = null;
  let lastData = null;

  // Exponential moving average (debiased, as TensorBoard's); null stays null.
  function smooth(values, weight) {
    if (!weight) return values;
    let last = 0, count = 0;
    return values.map(function (v) {
      if (v === null || v === undefined) return null;
      last = last * weight + (1 - weight) * v;
      count++;
      // Rounded to 12 digits: a constant series stays exactly constant (no 0.5 vs 0.50000000001 axis).
      return Number((last / (1 - Math.pow(weight, count))).toPrecision(12));
    });
  }

  function smoothing() {
    const select = document.getElementById("chart-smoothing");
    return select ? Number(select.value) : 0;
  }

  // A series as one dataset, or, smoothed, a faint raw line under its EMA.
  function seriesDatasets(label, values, color) {
    const weight = smoothing();
    if (!weight) return [{ label: label, data: values, borderColor: color, backgroundColor: color, pointRadius: 3 }];
    return [
      { label: "_" + label, data: values, borderColor: color + "40", backgroundColor: color + "40", pointRadius: 2 },
      { label: label + " (EMA " + weight + ")", data: smooth(values, weight), borderColor: color, backgroundColor: color, pointRadius: 0 },
    ];
  }

  function lineChart(id, datasets, steps) {
    const canvas = document.getElementById(id);
    if (!canvas) return;
    if (charts[id] && charts[id].data.datasets.length === datasets.length) {
      charts[id].data.labels = steps;
      charts[id].data.datasets.forEach(function (dataset, i) { dataset.data = datasets[i].data; dataset.label = datasets[i].label; });
      charts[id].update("none");
      return;
    }
    if (charts[id]) charts[id].destroy();
    const named = datasets.filter(function (d) { return !d.label.startsWith("_"); });
    charts[id] = new window.Chart(canvas, {
      type: "line",
      data: { labels: steps, datasets: datasets },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        spanGaps: false,  // a step that measured nothing is a gap, not a line through it
        interaction: { mode: "index", intersect: false },
        plugins: {
          legend: { display: named.length > 1, labels: { filter: function (item) { return !item.text.startsWith("_"); } } },
          tooltip: {
            filter: function (item) { return !item.dataset.label.startsWith("_") || named.length === 0; },
            callbacks: { label: function (ctx) { return ctx.dataset.label.replace(/^_/, "") + ": " + formatNumber(ctx.parsed.y); } },
          },
        },
        scales: { x: { title: { display: true, text: "step" } }, y: { ticks: { callback: formatTick } } },
      },
    });
  }

  function showNote(key, text) {
    const note = document.getElementById("note-" + key);
    if (!note) return;
    note.textContent = text || "";
    note.hidden = !text;
  }

  const PALETTE = ["#7c3aed", "#db2777", "#ea580c", "#0891b2", "#65a30d", "#475569"];

  function drawCharts(data) {
    lastData = data;
    const empty = document.getElementById("charts-empty");
    if (empty) empty.hidden = data.steps.length > 0;
    const weight = smoothing();
    const mean = smooth(data.reward_mean, weight);
    const std = smooth(data.reward_std, weight);
    // The band stays inside the rewards' range (the grader's declared one, else the lowest and
    // highest reward sampled): a 0/1 reward's mean - std below 0 is no reward anyone got.
    const range = data.reward_range;
    let clipped = false;
    const clip = function (v) {
      if (!range) return v;
      const inside = Math.min(range.high, Math.max(range.low, v));
      if (inside !== v) clipped = true;
      return inside;
    };
    const upper = mean.map(function (m, i) { return m === null ? null : clip(m + (std[i] || 0)); });
    const lower = mean.map(function (m, i) { return m === null ? null : clip(m - (std[i] || 0)); });
    const rewardSets = [
      { label: "_upper", data: upper, borderWidth: 0, pointRadius: 0, backgroundColor: "rgba(37,99,235,0.15)", fill: "+1" },
      { label: "_lower", data: lower, borderWidth: 0, pointRadius: 0, fill: false },
    ];
    if (weight) rewardSets.push({ label: "_raw", data: data.reward_mean, borderColor: "#2563eb40", backgroundColor: "#2563eb40", pointRadius: 2 });
    rewardSets.push({ label: weight ? "mean reward (EMA " + weight + ")" : "mean reward", data: mean, borderColor: "#2563eb", backgroundColor: "#2563eb", pointRadius: weight ? 0 : 3 });
    lineChart("chart-reward", rewardSets, data.steps);
    showNote("reward", clipped ? "The ± std band is cut at " + formatNumber(range.low) + " and " + formatNumber(range.high) + (range.source === "declared" ? ", the grader's declared range." : ", the lowest and highest reward this run's samples got.") : "");

    const validation = data.validation || { steps: [], reward_mean: [], evaluated: [] };
    validationChart(validation);
    showNote("validation", validation.steps.length ? validationNote(validation) : "No evaluation yet: the run evaluates its validation rows at step 0, every eval_interval steps and at the end.");

    const subs = Object.entries(data.sub_rewards || {});
    let subSets = [];
    subs.forEach(function ([name, values], i) { subSets = subSets.concat(seriesDatasets(name, values, PALETTE[i % PALETTE.length])); });
    lineChart("chart-sub_rewards", subSets, data.steps);
    showNote("sub_rewards", subs.length ? "" : "No sub-rewards recorded.");

    for (const [key, series] of Object.entries(data.series)) {
      const measured = series.values.some(function (v) { return v !== null; });
      const figure = document.getElementById("figure-" + key);
      const notMeasured = series.note && series.note.startsWith("Not measured") && !measured;
      if (figure) figure.classList.toggle("not-measured", Boolean(notMeasured));
      const canvas = document.getElementById("chart-" + key);
      if (canvas) canvas.hidden = Boolean(notMeasured && series.note.indexOf("kl_coef") >= 0);
      showNote(key, series.note);
      if (canvas && !canvas.hidden) lineChart("chart-" + key, seriesDatasets(series.label, series.values, "#0f766e"), data.steps);
    }
  }

  // One point per evaluation on a step axis, never joined: two evaluations steps apart say
  // where the run was at each, not how it went in between.
  function validationChart(validation) {
    const canvas = document.getElementById("chart-validation");
    if (!canvas) return;
    const points = validation.steps.map(function (step, i) {
      const evaluated = (validation.evaluated || [])[i] || {};
      return { x: step, y: validation.reward_mean[i], n: evaluated.n };
    });
    if (charts["chart-validation"]) charts["chart-validation"].destroy();
    charts["chart-validation"] = new window.Chart(canvas, {
      type: "line",
      data: { datasets: [{ label: "validation reward", data: points, showLine: false, borderColor: "#16a34a", backgroundColor: "#16a34a", pointRadius: 5 }] },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        plugins: {
          legend: { display: false },
          tooltip: { callbacks: { label: function (ctx) { return "step " + ctx.raw.x + ": " + formatNumber(ctx.raw.y) + (ctx.raw.n ? " over " + ctx.raw.n + " samples" : ""); } } },
        },
        scales: { x: { type: "linear", title: { display: true, text: "step" }, ticks: { precision: 0 } }, y: { ticks: { callback: formatTick } } },
      },
    });
  }

  function validationNote(validation) {
    const sizes = Array.from(new Set((validation.evaluated || []).map(function (e) { return e.n; }).filter(function (n) { return n; })));
    const each = sizes.length === 1 ? " (" + sizes[0] + " samples each)" : sizes.length > 1 ? " (" + sizes.join(", ") + " samples: not the same rows, so not comparable)" : "";
    return "One point per evaluation" + each + ", not joined: two evaluations are not a trend.";
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
  const smoothingSelect = document.getElementById("chart-smoothing");
  if (smoothingSelect) smoothingSelect.addEventListener("change", function () { if (lastData) drawCharts(lastData); });

  // --- trajectory viewer: keys for the links marked data-hotkey (j/k groups, [/] steps) --------
  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const target = event.target;
    if (target && (target.isContentEditable || ["INPUT", "SELECT", "TEXTAREA"].indexOf(target.tagName) >= 0)) return;
    if (event.key.length !== 1) return;
    const link = document.querySelector('a[data-hotkey="' + CSS.escape(event.key) + '"]');
    if (!link) return;
    event.preventDefault();
    window.location.assign(link.href);
  });

  // The viewer's filter form submits when a choice changes (the Show button stays for keyboards).
  const trajectoryFilters = document.getElementById("trajectory-filters");
  if (trajectoryFilters) {
    trajectoryFilters.addEventListener("change", function () { trajectoryFilters.submit(); });
  }

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
    // The live check replaces the spec's problems the server listed after a submit: the same
    // problems were shown twice, and once the spec is edited the server's list is stale.
    const field = form.querySelector("textarea[name=spec]").closest(".field");
    if (field) field.querySelectorAll(".field-errors").forEach(function (list) { list.remove(); });
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
