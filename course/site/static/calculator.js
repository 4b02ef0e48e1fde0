// The layout calculator (course/site/calculator.md). It computes nothing: it shows what course/site/calculator.py
// costed with module 18's own functions when the site was built, one script per case and mesh
// (_static/calculator/CASE/MESH.js), loaded when the mesh is first chosen. The plan's row is the text
// `python main.py plan` prints for the layout; the bars draw the planner's fields (StepCost's memory by kind,
// bytes by axis; StepTime's compute and times by axis). The choice lives in the address
// (?case=KEY&mesh=p1-d8-c1-t1-e1&zero=1&...), so a link or the browser check can open any layout.
"use strict";

(() => {
  const TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
  const KIND_COLOURS = {parameters: "#1f77b4", gradients: "#ff7f0e", optimizer: "#2ca02c", activations: "#d62728",
                        buffers: "#9467bd"};
  const SVG = "http://www.w3.org/2000/svg";
  const LABELS = {zero: "ZeRO", schedule: "schedule", m: "microbatches m", recompute: "recompute", fp8: "FP8",
                  cp: "context attention"};
  const data = window.CALCULATOR;
  const state = {};

  function element(tag, attributes = {}, ...children) {
    const node = ["svg", "rect", "text", "line", "title", "g"].includes(tag)
      ? document.createElementNS(SVG, tag) : document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
    node.append(...children);
    return node;
  }

  const gb = (bytes) => (bytes / 1e9).toFixed(1);
  const seconds = (s) => (s >= 1 ? s.toFixed(2) : (s * 1e3).toFixed(1) + " m") + "s";
  const caseOf = (key) => data.cases.find((c) => c.key === key) || data.cases[0];
  const shown = (value) => (value === true ? "on" : value === false ? "off" : String(value));

  function readAddress() {
    const query = new URLSearchParams(window.location.search);
    state.case = caseOf(query.get("case")).key;
    state.mesh = query.get("mesh");
    state.asked = {};
    for (const name of Object.keys(LABELS)) if (query.has(name)) state.asked[name] = query.get(name);
  }

  function writeAddress(layout) {
    const query = new URLSearchParams({case: state.case, mesh: state.mesh});
    caseOf(state.case).choices.forEach((name, i) => query.set(name, shown(layout[0][i])));
    try {
      window.history.replaceState(null, "", "?" + query.toString());
    } catch (error) { /* some browsers refuse it on file:// pages: the page works without it */ }
  }

  function loadMesh(caseKey, mesh) {
    const key = `${caseKey}/${mesh}`;
    if (data.layouts[key]) return Promise.resolve(data.layouts[key]);
    return new Promise((resolve, reject) => {
      const script = element("script", {src: `_static/calculator/${key}.js`});
      script.onload = () => resolve(data.layouts[key]);
      script.onerror = () => reject(new Error(`the layouts of ${key} did not load`));
      document.head.append(script);
    });
  }

  // The layout the choices name: each choice in turn keeps the asked value if some layout of the mesh has it
  // (with the choices before it), else the first such layout's.
  function choose(info, layouts) {
    let left = layouts;
    info.choices.forEach((name, i) => {
      const values = [...new Set(left.map((l) => shown(l[0][i])))];
      const value = values.includes(state.asked[name]) ? state.asked[name] : values[0];
      state.asked[name] = value;
      left = left.filter((l) => shown(l[0][i]) === value);
    });
    return left[0];
  }

  function selectBox(id, label, options, value, onChange, disabled = false) {
    const box = element("select", {id});
    for (const [key, text] of options) box.append(element("option", {value: key}, text));
    box.value = value;
    box.disabled = disabled;
    box.addEventListener("change", () => onChange(box.value));
    return element("label", {}, label, " ", box);
  }

  function controls(info, layouts) {
    const bar = element("div", {class: "calculator-controls"});
    bar.append(selectBox("calculator-case", "case", data.cases.map((c) => [c.key, c.title]), info.key, (key) => {
      state.case = key;   // opens at the case's fastest layout
      state.mesh = caseOf(key).fastest[0]?.mesh || null;
      state.pick = caseOf(key).fastest[0]?.name || null;
      update();
    }));
    bar.append(selectBox("calculator-mesh", "mesh", info.meshes.map((m) => [m.key, m.name]), state.mesh, (key) => {
      state.mesh = key;
      update();
    }));
    let left = layouts;
    info.choices.forEach((name, i) => {
      const values = [...new Set(left.map((l) => shown(l[0][i])))];
      bar.append(selectBox(`calculator-${name}`, LABELS[name] || name, values.map((v) => [v, v]), state.asked[name],
        (value) => {
          state.asked[name] = value;
          update();
        }, values.length < 2));
      left = left.filter((l) => shown(l[0][i]) === state.asked[name]);
    });
    return bar;
  }

  // Memory by kind, stacked, against the GPU's memory and the part the search lets a layout keep.
  function memoryBars(info, memory) {
    const kinds = Object.keys(memory);
    const total = kinds.reduce((sum, k) => sum + memory[k], 0);
    const scale = Math.max(total, info.gpu_memory) * 1.15;  // room for the GPU's label right of its line
    const width = 760, x = (bytes) => 10 + (width - 20) * bytes / scale;
    const svg = element("svg", {class: "calculator-bars", viewBox: `0 0 ${width} 70`, id: "calculator-memory",
                                "data-total": String(total)});
    let left = 0;
    kinds.forEach((kind, i) => {
      svg.append(element("rect", {x: x(left), y: 10, width: Math.max(x(left + memory[kind]) - x(left), 0), height: 26,
                                  fill: KIND_COLOURS[kind] || TAB10[i % 10]},
                         element("title", {}, `${kind}: ${gb(memory[kind])} GB`)));
      left += memory[kind];
    });
    for (const [bytes, label, anchor] of [[info.budget, "usable", "end"], [info.gpu_memory, "GPU", "start"]]) {
      svg.append(element("line", {x1: x(bytes), x2: x(bytes), y1: 4, y2: 42, class: "limit"}));
      svg.append(element("text", {x: x(bytes) + (anchor === "end" ? -4 : 4), y: 56, "text-anchor": anchor,
                                  class: "tick"}, `${label} ${gb(bytes)} GB`));
    }
    const legend = element("div", {class: "legend"});
    kinds.forEach((kind, i) => legend.append(
      element("span", {class: "swatch", style: `background:${KIND_COLOURS[kind] || TAB10[i % 10]}`}),
      ` ${kind} ${gb(memory[kind])} GB  `));
    legend.append(`= ${gb(total)} GB a GPU`);
    return [svg, legend];
  }

  function table(head, rows, attributes = {}) {
    return element("table", {class: "calculator-table", ...attributes},
      element("thead", {}, element("tr", {}, ...head.map((h) => element("th", {}, h)))),
      element("tbody", {}, ...rows.map((cells) => element("tr", {}, ...cells.map((c) => element("td", {}, c))))));
  }

  // StepTime as the planner returns it: compute and the exposed axes' times up to the step (the rest of the
  // step: the bubble, or the weights' traffic where it outlasts them), and the axes behind the compute.
  function timeBars(info, time) {
    const comm = time.comm || {};
    const busy = [["compute", time.compute], ...info.exposed.filter((a) => a in comm).map((a) => [a, comm[a]])];
    const used = busy.reduce((sum, [, s]) => sum + s, 0);
    const behind = info.hidden.filter((a) => a in comm).map((a) => [a, comm[a]]);
    const scale = Math.max(time.step, behind.reduce((sum, [, s]) => sum + s, 0)) * 1.05;
    const width = 760, x = (s) => 10 + (width - 20) * s / scale;
    const svg = element("svg", {class: "calculator-bars", viewBox: `0 0 ${width} 70`, id: "calculator-time"});
    const axes = [...info.exposed, ...info.hidden];
    const colour = (name) => (name === "compute" ? "#2ca02c" : name === "rest" ? "#cccccc"
      : TAB10[[0, 1, 3, 4, 5, 6, 8, 9][axes.indexOf(name) % 8]]);
    const legend = element("div", {class: "legend"});
    const draw = (parts, y, height) => {
      let left = 0;
      for (const [name, s] of parts) {
        svg.append(element("rect", {x: x(left), y, width: Math.max(x(left + s) - x(left), 0), height,
                                    fill: colour(name)}, element("title", {}, `${name}: ${seconds(s)}`)));
        legend.append(element("span", {class: "swatch", style: `background:${colour(name)}`}),
                      ` ${name === "rest" ? "rest of the step" : name} ${seconds(s)}  `);
        left += s;
      }
    };
    draw([...busy, ["rest", Math.max(time.step - used, 0)]], 6, 24);
    draw(behind, 36, 10);
    svg.append(element("text", {x: x(time.step), y: 62, "text-anchor": "middle", class: "tick"},
                       `step ${seconds(time.step)}`));
    const fields = [];
    for (const [name, value] of Object.entries(time)) {
      if (value !== null && typeof value === "object") {
        for (const [key, v] of Object.entries(value)) fields.push([`${name} ${key}`, v]);
      } else fields.push([name, value]);
    }
    const rows = fields.map(([name, v]) => [name, typeof v === "number" ?
      (name === "bubble" ? `${(100 * v).toFixed(1)} %` : name.includes("comm") || ["step", "compute"].includes(name)
        ? seconds(v) : String(v)) : String(v)]);
    const note = element("p", {class: "legend"}, "thick: compute, then the collectives the step waits for (",
      info.exposed.join(", "), "), then the rest of the step (grey); thin: the weights' traffic behind the compute (",
      info.hidden.join(", "), ").");
    return [svg, legend, note, table(["StepTime field", "value"], rows, {id: "calculator-steptime"})];
  }

  function command(info, layout) {
    const fields = Object.fromEntries(info.choices.map((name, i) => [name, layout[0][i]]));
    const sizes = Object.fromEntries(state.mesh.split("-").map((part) => [part[0], Number(part.slice(1))]));
    const mesh = Object.entries(sizes).map(([a, s]) => `${a}=${s}`).join(",");
    const parts = ["python main.py plan", ...info.arguments, "--mesh", mesh, "--zero", fields.zero, "--microbatches",
                   fields.m, "--recompute", fields.recompute, "--fp8", fields.fp8 ? "on" : "off"];
    if (sizes.p > 1) parts.push("--schedule", fields.schedule);
    if (sizes.c > 1) parts.push("--cp", fields.cp);
    return parts.concat(["--impl", "solutions"]).join(" ");
  }

  function show(info, layouts) {
    const layout = choose(info, layouts);
    writeAddress(layout);
    const [, name, memory, sent, calls, time, rest, miss] = layout;
    const out = element("div", {id: "calculator-output", "data-layout": name});
    out.append(element("h2", {}, name));
    out.append(element("p", {}, "The command that prints this layout's row: ",
                       element("code", {id: "calculator-command"}, command(info, layout))));
    const printed = element("pre", {id: "calculator-plan", class: "calculator-plan"});
    if (rest !== null) {
      printed.dataset.row = name + rest;
      printed.textContent = `${info.header}\n${name}${rest}`;
    } else {
      printed.dataset.miss = miss.replace("{layout}", name);
      printed.textContent = printed.dataset.miss;
      printed.classList.add("refused");
    }
    out.append(element("h3", {}, "What python main.py plan prints for it"), printed,
               ...info.above.map((line) => element("p", {class: "legend"}, line)));
    out.append(element("h3", {}, "Memory of one GPU, by kind"), ...memoryBars(info, memory));
    const axes = Object.keys(sent);
    out.append(element("h3", {}, "What one GPU sends in one step, by axis"),
               axes.length ? table(["axis", "GB sent", "collectives"],
                                   axes.map((a) => [a, gb(sent[a]), String(calls[a] || 0)]), {id: "calculator-sent"})
                 : element("p", {}, "Nothing: one GPU holds the whole model."));
    out.append(element("h3", {}, "Predicted step time"),
               ...(time ? timeBars(info, time) : [element("p", {}, "Not timed: the layout does not fit.")]));
    return out;
  }

  function fastestList(info) {
    const list = element("ol", {id: "calculator-fastest"});
    for (const f of info.fastest) {
      const query = new URLSearchParams({case: info.key, mesh: f.mesh});
      const link = element("a", {href: "?" + query.toString()}, f.name);
      link.addEventListener("click", (event) => {
        event.preventDefault();
        state.mesh = f.mesh;
        state.pick = f.name;
        update();
      });
      list.append(element("li", {}, link));
    }
    return list;
  }

  async function update() {
    const root = document.getElementById("calculator");
    const status = document.getElementById("calculator-status") || element("p", {id: "calculator-status"});
    status.dataset.ready = "0";
    const info = caseOf(state.case);
    if (!info.meshes.some((m) => m.key === state.mesh)) state.mesh = info.fastest.length ? info.fastest[0].mesh
      : info.meshes[0].key;
    let layouts;
    try {
      layouts = await loadMesh(info.key, state.mesh);
    } catch (error) {
      root.replaceChildren(element("p", {class: "refused"}, error.message));
      return;
    }
    if (state.pick) {  // a layout of the fastest list: its choices exactly
      const found = layouts.find((l) => l[1] === state.pick);
      if (found) info.choices.forEach((name, i) => { state.asked[name] = shown(found[0][i]); });
      state.pick = null;
    }
    const output = show(info, layouts);  // first: it settles the choices the controls show
    root.replaceChildren(
      element("p", {}, `${info.title}: ${info.costed} layouts costed, ${info.fit} fit in ${gb(info.budget)} GB ` +
              `of the GPU's ${gb(info.gpu_memory)} GB. Choose a mesh, then the other choices:`),
      controls(info, layouts), output,
      element("h3", {}, "The fastest layout of each of the fastest meshes"), fastestList(info), status);
    status.textContent = "";
    status.dataset.ready = "1";
  }

  readAddress();
  if (!state.mesh) state.pick = caseOf(state.case).fastest[0]?.name || null;
  document.addEventListener("DOMContentLoaded", update);
})();
