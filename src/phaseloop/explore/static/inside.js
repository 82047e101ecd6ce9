// Inside a trained model: every number from /api/inside/* (phaseloop.analysis.probe).
"use strict";

const $ = (id) => document.getElementById(id);
const LAYOUT = {margin: {t: 30, r: 10, l: 60, b: 40}, height: 320};
let current = null;  // {root, path, prompt | window}
const latest = {};  // kind -> number of the latest request: older answers are dropped

function newest(kind) {  // a ticket; ticket() is true while no later request of that kind began
  const n = latest[kind] = (latest[kind] || 0) + 1;
  return () => latest[kind] === n;
}

function input() {
  const [root, path] = JSON.parse($("run").value);
  const w = $("window").value;
  return w === "" ? {root, path, prompt: $("prompt").value} : {root, path, window: w};
}

function shown(t) { return t.replace(/\n/g, "⏎"); }

function colour(v, lo, hi) {  // white -> red
  const x = hi > lo ? Math.max(0, Math.min(1, (v - lo) / (hi - lo))) : 0;
  return `rgb(255,${Math.round(255 - 180 * x)},${Math.round(255 - 200 * x)})`;
}

function tokenSpans(box, tokens, values, title) {
  box.innerHTML = "";
  const vals = values.filter(v => v != null);
  const lo = Math.min(...vals), hi = Math.max(...vals);
  tokens.forEach((t, i) => {
    const s = document.createElement("span");
    s.className = "tok";
    s.textContent = shown(t);
    s.dataset.value = values[i] == null ? "" : values[i];
    if (values[i] != null) s.style.background = colour(values[i], lo, hi);
    s.title = title(i);
    box.appendChild(s);
  });
}

function heat(div, z, x, y, title, extra, layout) {
  Plotly.react(div, [{type: "heatmap", z, x, y, colorscale: "Viridis", ...(extra || {})}],
               {...LAYOUT, title: {text: title, font: {size: 13}}, ...(layout || {})});
}

async function analyse() {
  const ticket = newest("analyse");
  current = input();
  const a = await api("/api/inside/analyze", current);
  if (!ticket()) return;
  const T = a.tokens.length;
  $("model-info").textContent = `${a.arch}, max_seq_len ${a.max_seq_len}, vocabulary ${a.vocab_size}`;
  $("mean-loss").textContent = a.mean_loss.toFixed(4);
  $("n-tokens").textContent = T;
  const loss = [null, ...a.loss];
  tokenSpans($("tokens"), a.tokens, loss, i => i ? `loss ${loss[i].toFixed(3)}` : "first token: no loss");
  Plotly.react("loss-chart", [{x: [...Array(T).keys()], y: loss, type: "bar"}],
               {...LAYOUT, height: 220, xaxis: {title: "position"}, yaxis: {title: "loss (nats)"}});

  $("ponder-section").hidden = !a.ponder;
  if (a.ponder) {
    tokenSpans($("ponder"), a.tokens, a.ponder, i => `ponder ${a.ponder[i].toFixed(3)}; p per step: ` +
      a.halting.map((row, t) => `${t + 1}: ${a.halted[t][i] ? "halted" : row[i].toFixed(3)}`).join(", "));
    // a.halted (from the API): the steps after a position halted carry weight 0, shown grey (gaps)
    heat("halting-chart", a.halting.map((row, t) => row.map((p, i) => a.halted[t][i] ? null : p)),
         [...Array(T).keys()], a.halting.map((_, t) => `step ${t + 1}`),
         "halting probability per step and position (grey: halted, weight 0)", {hoverongaps: false},
         {xaxis: {title: "position"}, plot_bgcolor: "#d0d0d0"});
  }

  $("phase-section").hidden = !(a.angles || a.stripes);
  if (a.angles) {
    heat("angles-chart", a.angles.theta, null, a.angles.theta.map((_, l) => `layer ${l}`),
         "rotation angle θ (rad), layer × channel pair", null, {xaxis: {title: "channel pair k"}});
    Plotly.react("drift-chart", [
      {x: a.angles.drift.map(r => r.layer), y: a.angles.drift.map(r => r.mean_abs_drift), name: "mean |θ − θ_init|"},
      {x: a.angles.drift.map(r => r.layer), y: a.angles.drift.map(r => r.max_abs_drift), name: "max |θ − θ_init|"}],
      {...LAYOUT, height: 250, title: {text: "angle drift (three_phase.angle_drift)", font: {size: 13}},
       xaxis: {title: "layer", dtick: 1}});
  }
  if (a.stripes) {
    const sites = a.stripes.map(r => r.site);
    const traces = a.stripes[0].stripe_means.map((_, i) => ({x: sites, y: a.stripes.map(r => r.stripe_means[i]),
                                                            type: "bar", name: `stripe ${i}`}));
    traces.push({x: sites, y: a.stripes.map(r => r.zero_sum), name: "Σ stripes (zero-sum)", mode: "lines+markers"});
    Plotly.react("stripes-chart", traces, {...LAYOUT, title: {text: "per-phase stripe means after every layer application", font: {size: 13}}});
    heat("dc-chart", a.stripes.map(r => r.dc), [...Array(T).keys()], sites,
         "DC (mean over channels) per token, after every layer application (the horn sets 1/(t+1))", null,
         {margin: {...LAYOUT.margin, l: 120}, xaxis: {title: "position t"}});
  }

  $("mix-section").hidden = !a.mixing;
  if (a.mixing) {
    $("mix-site").innerHTML = a.mixing.map((m, i) => `<option value="${i}">${m.site}</option>`).join("");
    drawMixing(a);
    $("mix-site").onchange = () => drawMixing(a);
  }

  $("attn-site").innerHTML = a.attention_sites.map((s, i) => `<option value="${i}">${s}</option>`).join("");
  $("attn-head").innerHTML = [...Array(a.heads).keys()].map(h => `<option value="${h}">${h}</option>`).join("");
  await drawAttention();

  $("pos").max = T - 1; $("pos").value = T - 1;
  $("topk").max = a.vocab_size;
  if (+$("topk").value > a.vocab_size || !$("topk").dataset.touched) $("topk").value = a.vocab_size;
  await drawNext();

  $("gen-section").hidden = !a.dynamic_depth;
  if (a.dynamic_depth) await drawGeneration();
  $("depth-section").hidden = !a.dynamic_depth;
  if (a.dynamic_depth) {
    const d = await api("/api/inside/depth", current);
    if (!ticket()) return;
    Plotly.react("depth-chart", [{x: d.rows.map(r => r.depth), y: d.rows.map(r => r.loss), mode: "lines+markers"}],
                 {...LAYOUT, height: 260, xaxis: {title: "passes / steps"}, yaxis: {title: "mean loss (nats)"}});
  }
  $("model-info").dataset.done = current.prompt ?? "window " + current.window;  // every section drawn
}

function drawMixing(a) {
  const m = a.mixing[+$("mix-site").value];
  const n = m.pre[0].length, streams = [...Array(n).keys()].map(i => `stream ${i}`);
  const res = m.res == null ? null : (Array.isArray(m.res[0][0]) ? m.res.map(r => r.map((row, i) => row[i])) : m.res);
  const z = [...m.pre[0].map((_, i) => m.pre.map(r => r[i])), ...m.post[0].map((_, i) => m.post.map(r => r[i])),
             ...(res ? res[0].map((_, i) => res.map(r => r[i])) : [])];
  const y = [...streams.map(s => "H_pre " + s), ...streams.map(s => "H_post " + s), ...(res ? streams.map(s => "H_res " + s) : [])];
  heat("mix-chart", z, [...Array(m.pre.length).keys()], y, `${m.site}: coefficients per token`, null,
       {margin: {...LAYOUT.margin, l: 120}, xaxis: {title: "position"}});
  if (m.similarity)
    heat("sim-chart", m.similarity, streams, streams,
         `cosine similarity of the streams it wrote` + (m.vs_previous ? `; vs the previous application: ${m.vs_previous.map(v => v.toFixed(3)).join(", ")}` : ""));
}

async function drawGeneration() {
  const ticket = newest("generate");
  $("gen-figures").dataset.done = "";
  const r = await api("/api/inside/generate", {...current, exit: $("gen-exit").value, kv_fill: $("gen-fill").value,
                                               kv_share: $("gen-share").value, speculative: $("gen-spec").value,
                                               max_new_tokens: $("gen-n").value, temperature: $("gen-temp").value});
  if (!ticket()) return;
  tokenSpans($("gen-tokens"), r.tokens, r.passes, i => `passes ${r.passes[i].toFixed(2)} of ${r.depth}`);
  Plotly.react("gen-chart", [{x: r.tokens.map((t, i) => `${i}:${shown(t)}`), y: r.passes, type: "bar", name: "passes"}],
               {...LAYOUT, height: 220, xaxis: {title: "generated token"},
                yaxis: {title: "loop passes", range: [0, r.depth + 0.5]}});
  $("gen-figures").textContent = `mean ${r.mean_passes.toFixed(2)} of ${r.depth} passes per token, ` +
    `${r.tokens_per_s.toFixed(1)} tokens/s, KV cache ${fmtInt(r.kv_cache_bytes)} bytes` +
    (r.acceptance == null ? "" : `, ${(100 * r.acceptance).toFixed(1)} % of the drafts accepted`);
  $("gen-figures").dataset.done = r.tokens.join("");
}

async function drawAttention() {
  if (!$("attn-site").options.length) return;
  const ticket = newest("attention");
  const r = await api("/api/inside/attention", {...current, site: $("attn-site").value, head: $("attn-head").value});
  if (!ticket()) return;
  const labels = r.tokens.map((t, i) => `${i}:${shown(t)}`);
  heat("attn-chart", r.weights, labels, labels, `${r.site}, head ${r.head} (row: query, column: key)`,
       {colorscale: "Blues"});
}

async function drawNext() {
  $("pos-val").textContent = $("pos").value;
  $("temp-val").textContent = $("temp").value;
  $("topk-val").textContent = $("topk").value;
  const ticket = newest("next");
  const r = await api("/api/inside/next", {...current, pos: $("pos").value, temperature: $("temp").value,
                                           top_k: $("topk").value});
  if (!ticket()) return;
  $("next-table").querySelector("tbody").innerHTML = "";
  for (const t of r.tokens) {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td class=tok></td><td class=p></td><td></td>";
    tr.children[0].textContent = JSON.stringify(t.text);
    tr.children[1].textContent = t.p.toFixed(4);
    tr.children[2].textContent = t.logit.toFixed(3);
    $("next-table").querySelector("tbody").appendChild(tr);
  }
}

api("/api/inside/runs").then(({runs}) => {
  const q = new URLSearchParams(location.search);
  $("run").innerHTML = runs.map(r => {
    const v = JSON.stringify([r.root, r.path]);
    const sel = r.root === q.get("root") && r.path === (q.get("path") || "") ? " selected" : "";
    return `<option value="${esc(v)}"${sel}>${esc(r.name)}</option>`;
  }).join("");
  $("go").onclick = () => analyse().catch(() => {});
  $("gen-go").onclick = () => drawGeneration().catch(() => {});
  $("attn-site").onchange = $("attn-head").onchange = () => drawAttention().catch(() => {});
  for (const id of ["pos", "temp", "topk"])
    $(id).oninput = () => { $(id).dataset.touched = 1; drawNext().catch(() => {}); };
  if (runs.length) analyse().catch(() => {});
});
