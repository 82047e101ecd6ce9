// Runs pages: curves polled from /api/runs/curves (downsampled there), drawn with plotly.
"use strict";

const POLL_MS = 2000;

function runLabel(r) { return r.path ? `${r.root}/${r.path}` : r.root; }

// Draw the loss and BPB curves of `runs` ([{root, path}]) and keep them current while
// any of them is still training. Returns a function that stops polling.
function followCurves(runs, lossDiv, bpbDiv, statusEl) {
  let timer = null, stopped = false;
  async function tick() {
    const data = await Promise.all(runs.map(r => api("/api/runs/curves", {root: r.root, path: r.path})));
    if (stopped) return;  // the selection changed while this poll was out
    const loss = [], bpb = [];
    data.forEach((d, i) => {
      const name = runLabel(runs[i]);
      loss.push({x: d.train.step, y: d.train.loss, name: name + " train",
                 mode: d.train.step.length < 50 ? "lines+markers" : "lines"});
      loss.push({x: d.eval.step, y: d.eval.val_loss, name: name + " val", mode: "lines+markers"});
      bpb.push({x: d.eval.step, y: d.eval.val_bpb, name: name + " val", mode: "lines+markers"});
    });
    const lay = (y) => ({margin: {t: 10, r: 10}, xaxis: {title: "step"}, yaxis: {title: y}, height: 330,
                         legend: {orientation: "h"}});
    Plotly.react(lossDiv, loss, lay("loss (nats/token)"));
    Plotly.react(bpbDiv, bpb, lay("validation bits per byte"));
    statusEl.innerHTML = "";
    data.forEach((d, i) => {
      const li = document.createElement("li");
      const last = d.train.step.length ? d.train.step[d.train.step.length - 1] : null;
      const lastVal = d.eval.val_loss.length ? d.eval.val_loss[d.eval.val_loss.length - 1] : null;
      li.innerHTML = `<code>${esc(runLabel(runs[i]))}</code>: <span class="records">${fmtInt(d.records)}</span> records, ` +
        `last step <span class="last-step">${last ?? "—"}</span> of ${d.steps ?? "?"}, ` +
        `val loss <span class="last-val">${lastVal == null ? "—" : lastVal.toFixed(4)}</span>` +
        (d.finished ? " (finished)" : " (training…)") +
        (d.train.n > d.train.step.length ? ` — ${fmtInt(d.train.n)} training records drawn as ${d.train.step.length} points` : "") +
        (d.damaged_lines ? ` — ${d.damaged_lines} damaged line(s) skipped` : "");
      statusEl.appendChild(li);
    });
    if (!stopped && data.some(d => !d.finished)) timer = setTimeout(tick, POLL_MS);
  }
  tick().catch(() => {});
  return () => { stopped = true; if (timer) clearTimeout(timer); };
}
