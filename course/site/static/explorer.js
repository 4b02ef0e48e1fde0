// The schedule explorer (course/site/explorer.md). It computes nothing: it draws what course/site/explorer.py
// precomputed with the course's simulator, one script of data per schedule (_static/explorer/NAME.js),
// loaded when the schedule is first chosen. The choice lives in the page's address
// (?schedule=zbv&p=4&m=8&v=2&F=1&I=1&W=1), so a link or the browser check can open any configuration.
"use strict";

(() => {
  const TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
  const TAB20 = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896",
                 "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7",
                 "#bcbd22", "#dbdb8d", "#17becf", "#9edae5"];
  const KINDS = {F: "forward", B: "full backward", I: "input gradient", W: "weight gradient"};
  const SVG = "http://www.w3.org/2000/svg";
  const CHOICES = ["schedule", "p", "m", "v", "F", "I", "W"];

  const {index} = window.EXPLORER;
  const info = Object.fromEntries(index.schedules.map((s) => [s.name, s]));
  const state = {};

  function element(tag, attributes = {}, ...children) {
    const node = tag === "svg" || ["rect", "text", "line", "pattern", "path", "defs", "title", "g"].includes(tag)
      ? document.createElementNS(SVG, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    node.append(...children);
    return node;
  }

  // The choice: the address's, where it is one of the grid's values, else the default; returns what was
  // asked for and is not in the grid.
  function readAddress() {
    const query = new URLSearchParams(window.location.search);
    const allowed = {schedule: index.schedules.map((s) => s.name), p: index.grid.p, m: index.grid.m,
                     v: index.grid.v, F: index.grid.costs, I: index.grid.costs, W: index.grid.costs};
    const outside = [];
    for (const name of CHOICES) {
      const value = name === "schedule" ? query.get(name) : Number(query.get(name));
      state[name] = query.has(name) && allowed[name].includes(value) ? value : index.default[name];
      if (query.has(name) && state[name] !== value) outside.push(`${name} = ${query.get(name)}`);
    }
    if (!info[state.schedule]) state.schedule = index.schedules[0].name;
    return outside;
  }

  function writeAddress() {
    const query = new URLSearchParams(CHOICES.map((name) => [name, state[name]]));
    try {
      window.history.replaceState(null, "", "?" + query.toString());
    } catch (error) { /* some browsers refuse it on file:// pages: the page works without it */ }
  }

  function loadSchedule(name) {
    if (window.EXPLORER.schedules[name]) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const script = element("script", {src: `_static/explorer/${name}.js`});
      script.onload = resolve;
      script.onerror = () => reject(new Error(`the data of ${name} did not load`));
      document.head.append(script);
    });
  }

  function select(name, label, values, describe = String) {
    const box = element("select", {id: `choose-${name}`, name});
    for (const value of values) box.append(element("option", {value}, describe(value)));
    box.value = state[name];
    box.addEventListener("change", () => {
      state[name] = name === "schedule" ? box.value : Number(box.value);
      update();
    });
    return element("label", {}, label, " ", box);
  }

  function math(tex, display = false) {
    const node = element(display ? "div" : "span", {class: "explorer-math"});
    if (window.katex) window.katex.render(tex, node, {displayMode: display, throwOnError: false});
    else node.textContent = tex;
    return node;
  }

  const fraction = (text) => text.split("/").map(Number).reduce((a, b) => a / b);
  const percent = (text) => `${(100 * fraction(text)).toFixed(1)} %`;
  const texFraction = (text) => (text.includes("/") ? `\\tfrac{${text.replace("/", "}{")}}` : text);

  function cost(kind) {
    return kind === "B" ? state.I + state.W : state[kind];
  }

  function timeline(config, run, stagesPerRank) {
    const p = config.orders.length;
    const width = 1200, left = 58, row = 34, top = 8, plot = width - left - 10;
    const scale = plot / run.makespan;
    const height = top + p * row + 34;
    const colours = state.m > 10 ? TAB20 : TAB10;
    const svg = element("svg", {viewBox: `0 0 ${width} ${height}`, class: "explorer-timeline", role: "img",
                                "aria-label": `timeline of ${state.schedule}`});
    const defs = element("defs");
    for (const [id, path] of [["hatch-B", "M0,8 L8,0"], ["hatch-I", "M0,0 L8,8"]]) {
      const pattern = element("pattern", {id, width: 6, height: 6, patternUnits: "userSpaceOnUse",
                                          patternTransform: "scale(0.75)"});
      pattern.append(element("path", {d: path, stroke: "#000", "stroke-width": 1.1, "stroke-opacity": 0.55}));
      defs.append(pattern);
    }
    svg.append(defs);
    for (let rank = 0; rank < p; rank++) {
      const y = top + rank * row;
      svg.append(element("rect", {x: left, y: y + 2, width: plot, height: row - 4, class: "idle"}));
      svg.append(element("text", {x: left - 6, y: y + row / 2 + 4, "text-anchor": "end", class: "rank"}, `rank ${rank}`));
      config.orders[rank].split(" ").forEach((text, i) => {
        const [, stage, kind, microbatch] = text.match(/^(\d+)([FBIW])(\d+)$/).map((x, j) => (j === 2 ? x : Number(x)));
        const start = run.start[rank][i], duration = cost(kind);
        const x = left + start * scale, w = duration * scale;
        const pale = kind === "W" || stage >= p;
        const block = element("g", {class: `action kind-${kind}`});
        block.append(element("title", {}, `rank ${rank}: ${text}, ${KINDS[kind]} of stage ${stage} for microbatch ` +
                                          `${microbatch}, from ${start} to ${start + duration}`));
        block.append(element("rect", {x, y: y + 3, width: w, height: row - 6, fill: colours[microbatch % colours.length],
                                      "fill-opacity": pale ? 0.45 : 1, stroke: "#000", "stroke-width": 0.5}));
        if (kind === "B" || kind === "I") {
          block.append(element("rect", {x, y: y + 3, width: w, height: row - 6, fill: `url(#hatch-${kind})`}));
        }
        const label = stagesPerRank > 1 ? `${stage}:${microbatch}` : String(microbatch);
        if (w > 7 * label.length) {
          block.append(element("text", {x: x + w / 2, y: y + row / 2 + 4, "text-anchor": "middle", class: "label"}, label));
        }
        svg.append(block);
      });
    }
    const axis = top + p * row + 4;
    const step = Math.max(1, Math.ceil(run.makespan / 20));
    for (let t = 0; t <= run.makespan; t += step) {
      svg.append(element("line", {x1: left + t * scale, x2: left + t * scale, y1: axis, y2: axis + 5, class: "tick"}));
      svg.append(element("text", {x: left + t * scale, y: axis + 17, "text-anchor": "middle", class: "tick"}, String(t)));
    }
    svg.append(element("text", {x: left + plot / 2, y: axis + 30, "text-anchor": "middle", class: "tick"},
                       "time, in units of the costs"));
    return svg;
  }

  function closedForm(data, config, run, stagesPerRank) {
    const box = element("div", {id: "closed-form"});
    if (run.closed.error) {
      box.append(element("p", {}, "Closed form: none here. ", element("em", {}, run.closed.error)));
      return box;
    }
    const tauB = state.I + state.W;
    const compute = state.m * stagesPerRank * (state.F + tauB);
    const form = data.form ? `${data.form} = ` : "";
    box.append(element("p", {}, "Closed form (", element("code", {}, "idle_per_rank"), ", ",
                       element("code", {}, "bubble_formula"), "), with ", math(`\\tau_B = \\tau_I + \\tau_W = ${tauB}`), ":"));
    box.append(math(`\\text{idle} = ${form}${texFraction(run.closed.idle)}, \\qquad \\text{bubble} = ` +
                    `\\frac{\\text{idle}}{m\\,v\\,(\\tau_F+\\tau_B) + \\text{idle}} = ` +
                    `\\frac{${texFraction(run.closed.idle)}}{${compute} + ${texFraction(run.closed.idle)}} = ` +
                    `${texFraction(run.closed.bubble)}`, true));
    const same = run.closed.bubble === run.bubble;
    box.append(element("p", {id: "bubble-closed", "data-value": run.closed.bubble,
                             class: same ? "agrees" : "differs"},
                       `${percent(run.closed.bubble)}: ` + (same ? "the simulator agrees."
                         : `the simulator finds ${run.bubble}: the form assumes what this run does not.`)));
    return box;
  }

  function ranksTable(config, run) {
    const table = element("table", {id: "ranks", class: "table"});
    table.append(element("thead", {}, element("tr", {}, ...["rank", "stages", "actions", "compute", "idle",
      "peak activations"].map((h) => element("th", {}, h)))));
    const body = element("tbody");
    config.orders.forEach((order, rank) => {
      const stages = config.placement.map((holder, stage) => [holder, stage]).filter(([holder]) => holder === rank)
        .map(([, stage]) => stage).join(", ");
      const busy = run.makespan - run.idle[rank];
      body.append(element("tr", {}, ...[rank, stages, order.split(" ").length, busy, run.idle[rank],
        config.peak_live[rank]].map((x) => element("td", {}, String(x)))));
    });
    table.append(body);
    return table;
  }

  function render() {
    const out = document.getElementById("explorer-output");
    const data = window.EXPLORER.schedules[state.schedule];
    const stagesPerRank = info[state.schedule].takes_v ? state.v : info[state.schedule].v;
    const key = `${state.p},${state.m},${stagesPerRank}`;
    out.replaceChildren();
    out.dataset.config = `${state.schedule},${key}`;
    if (data.refused[key]) {
      out.append(element("p", {id: "refused", class: "refused"}, `${state.schedule} refuses p = ${state.p}, ` +
                         `m = ${state.m}: ${data.refused[key]}`));
      return;
    }
    const config = data.configs[key];
    const run = config.runs[`${state.F},${state.I},${state.W}`];
    out.append(element("p", {class: "summary"},
      element("strong", {}, "Simulated bubble "),
      element("span", {id: "bubble-simulated", "data-value": run.bubble}, `${run.bubble} = ${percent(run.bubble)}`),
      ` of a step of ${run.makespan} units; each rank computes ${run.makespan - run.idle[0]}` +
      (run.idle.every((x) => x === run.idle[0]) ? ` and idles ${run.idle[0]}.` : " (see the table).")));
    out.append(timeline(config, run, stagesPerRank));
    out.append(element("p", {class: "legend"}, "Solid: forward (F). Hatched //: full backward (B). Hatched \\\\: " +
      "input gradient (I). Pale: weight gradient (W), and a rank's later stages. Labels: microbatch, or " +
      "stage:microbatch where a rank holds several stages. Grey: idle. Hover a block for its action."));
    out.append(closedForm(data, config, run, stagesPerRank));
    out.append(element("p", {}, "Peak activations: the most (stage, microbatch) activations a rank keeps at once, " +
                       "each kept from its F to its B, or to its W."));
    out.append(ranksTable(config, run));
    const orders = element("pre", {id: "orders"}, config.orders.map((o, r) => `rank ${r}: ${o}`).join("\n"));
    out.append(element("details", {}, element("summary", {}, "The schedule as data (Schedule.table())"), orders));
  }

  function update() {
    const takesV = info[state.schedule].takes_v;
    document.getElementById("choose-v").disabled = !takesV;
    document.getElementById("v-fixed").textContent = takesV ? "" : `(${state.schedule}: v = ${info[state.schedule].v})`;
    document.getElementById("schedule-summary").textContent = info[state.schedule].summary;
    writeAddress();
    const status = document.getElementById("explorer-status");
    status.dataset.ready = "0";
    loadSchedule(state.schedule).then(() => {
      render();
      status.textContent = "";
      status.dataset.ready = "1";
    }, (error) => {
      status.textContent = error.message;
      status.dataset.ready = "error";
    });
  }

  function start() {
    const outside = readAddress();
    const root = document.getElementById("explorer");
    const costs = (kind) => select(kind, element("span", {}, "τ", element("sub", {}, kind)), index.grid.costs);
    root.replaceChildren(
      element("div", {class: "explorer-controls"},
        select("schedule", "schedule", index.schedules.map((s) => s.name)),
        select("p", "p", index.grid.p), select("m", "m", index.grid.m), select("v", "v", index.grid.v),
        element("span", {id: "v-fixed", class: "v-fixed"}),
        costs("F"), costs("I"), costs("W")),
      element("p", {id: "schedule-summary", class: "schedule-summary"}),
      element("p", {id: "outside-grid", class: "refused"}, outside.length ? `Not in the grid the site was built with: ` +
              `${outside.join(", ")}; shown with the default value instead.` : ""),
      element("p", {id: "explorer-status", "data-ready": "0"}, "loading..."),
      element("div", {id: "explorer-output"}));
    update();
  }

  // KaTeX comes with the page's deferred scripts: start once they have run.
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
