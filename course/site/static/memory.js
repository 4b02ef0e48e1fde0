// The memory explorer (course/site/memory.md): draws what course/site/memory.py computed with module 13's
// cost functions, _static/memory/data.js. The choice lives in the address (?model=0&dtype=bfloat16&ranks=8&
// sequences=1), as the schedule explorer's does.
"use strict";

(() => {
  const data = window.MEMORY;
  const KEPT = [["parameters", "#1f77b4"], ["gradients", "#ff7f0e"], ["optimizer", "#2ca02c"],
                ["activations", "#d62728"]];
  // What a rank sends, by axis and kind of collective (module 13's StepCost.sent).
  const SENT = [["d all_gather", "#9467bd"], ["d reduce_scatter", "#8c564b"], ["t all_gather", "#e377c2"],
                ["t reduce_scatter", "#7f7f7f"], ["t all_reduce", "#bcbd22"], ["d all_reduce", "#17becf"]];
  const total = (s) => SENT.reduce((sum, [key]) => sum + s[key], 0);
  const SVG = "http://www.w3.org/2000/svg";
  const state = {};

  function element(tag, attributes = {}, ...children) {
    const node = ["svg", "rect", "text", "title", "g"].includes(tag)
      ? document.createElementNS(SVG, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    node.append(...children);
    return node;
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(n < 10 && i > 0 ? 2 : n < 100 && i > 0 ? 1 : 0)} ${units[i]}`;
  }

  function readAddress() {
    const query = new URLSearchParams(window.location.search);
    const pick = (name, values, fallback) => {
      const value = query.get(name);
      const found = values.map(String).indexOf(value);
      return found >= 0 ? values[found] : fallback;
    };
    state.model = pick("model", data.models.map((m, i) => i), 0);
    state.dtype = pick("dtype", data.dtypes, "bfloat16");
    state.ranks = pick("ranks", data.ranks, 4);
    state.sequences = pick("sequences", data.sequences, 1);
  }

  function select(name, label, values, describe = String) {
    const box = element("select", {id: `memory-${name}`});
    values.forEach((value) => box.append(element("option", {value: String(value)}, describe(value))));
    box.value = String(state[name]);
    box.addEventListener("change", () => {
      state[name] = typeof state[name] === "number" ? Number(box.value) : box.value;
      render();
    });
    return element("label", {}, label, " ", box);
  }

  function bars(rows, parts, total, scale) {
    const width = 540, height = 22 * rows.length + 4;  // 50 for the mesh's name, 80 for the total
    const svg = element("svg", {viewBox: `0 0 ${50 + width + 80} ${height}`, class: "memory-bars"});
    rows.forEach(([mesh, values], i) => {
      svg.append(element("text", {x: 0, y: 22 * i + 16, class: "mesh"}, mesh));
      let x = 50;
      for (const [part, colour] of parts) {
        const w = scale ? (values[part] / scale) * width : 0;
        svg.append(element("rect", {x, y: 22 * i + 3, width: Math.max(w, 0), height: 16, fill: colour},
                           element("title", {}, `${mesh}: ${part} ${bytes(values[part])}`)));
        x += w;
      }
      svg.append(element("text", {x: x + 4, y: 22 * i + 16, class: "mesh"}, bytes(total(values))));
    });
    return svg;
  }

  function legend(parts) {
    return element("p", {class: "legend"}, ...parts.flatMap(([part, colour]) =>
      [element("span", {class: "swatch", style: `background:${colour}`}), ` ${part}  `]));
  }

  function render() {
    const query = new URLSearchParams({model: state.model, dtype: state.dtype, ranks: state.ranks,
                                       sequences: state.sequences});
    try { window.history.replaceState(null, "", "?" + query.toString()); } catch (error) { /* file:// */ }
    const model = data.models[state.model];
    const table = model.table[`${state.dtype},${state.ranks},${state.sequences}`];
    const out = document.getElementById("memory-output");
    out.replaceChildren();
    const fit = Object.entries(table).filter(([, v]) => !v.refused);
    const kept = (v) => v.parameters + v.gradients + v.optimizer + v.activations;
    const sent = (v) => total(v.sent);
    out.append(element("p", {}, `One rank of ${state.ranks}, a global batch of ${state.sequences} x d sequences ` +
                       `of ${model.tokens} tokens, weights and activations in ${state.dtype}, AdamW.`));
    if (fit.length) {
      out.append(element("h3", {}, "Bytes kept by one rank"), legend(KEPT));
      out.append(bars(fit, KEPT, kept, Math.max(...fit.map(([, v]) => kept(v)))));
      out.append(element("h3", {}, "Bytes one rank sends in a step"), legend(SENT));
      out.append(bars(fit.map(([mesh, v]) => [mesh, v.sent]), SENT,
                      total,
                      Math.max(...fit.map(([, v]) => sent(v)))));
    }
    const head = ["mesh d x t", "parameters", "gradients", "optimizer", "activations", "kept", "sent"];
    const rows = Object.entries(table).map(([mesh, v]) => element("tr", {"data-mesh": mesh,
        "data-kept": v.refused ? "" : String(kept(v))}, element("td", {}, mesh),
      ...(v.refused ? [element("td", {colspan: 6, class: "refused"}, v.refused)]
        : [v.parameters, v.gradients, v.optimizer, v.activations, kept(v), sent(v)].map((n) =>
          element("td", {title: `${Math.round(n)} bytes`}, bytes(n))))));
    out.append(element("table", {id: "memory-table", class: "table"},
      element("thead", {}, element("tr", {}, ...head.map((h) => element("th", {}, h)))),
      element("tbody", {}, ...rows)));
    document.getElementById("memory-status").dataset.ready = "1";
  }

  function start() {
    readAddress();
    document.getElementById("memory").replaceChildren(
      element("div", {class: "explorer-controls"},
        select("model", "model", data.models.map((m, i) => i), (i) => data.models[i].name),
        select("dtype", "dtype", data.dtypes), select("ranks", "ranks d x t", data.ranks),
        select("sequences", "sequences per data rank", data.sequences)),
      element("p", {id: "memory-status", "data-ready": "0"}),
      element("div", {id: "memory-output"}));
    render();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
