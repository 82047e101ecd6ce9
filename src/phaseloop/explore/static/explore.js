// Shared page helpers: every number comes from /api (the pages never compute one).
"use strict";

// Every plot's config: no plotly logo in the mode bar (a link to plotly.com; the app is offline).
if (typeof Plotly !== "undefined") Plotly.setPlotConfig({displaylogo: false});

// Text from the served folders (run and variant names, a recipe's description, file names)
// put into HTML: escaped, so it is shown, never run or fetched.
function esc(text) {
  return String(text ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
}

async function api(path, params) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params || {})) url.searchParams.set(k, v);
  const r = await fetch(url);
  const body = await r.json();
  const box = document.getElementById("error");
  if (!r.ok) {
    if (box) { box.textContent = body.error || r.statusText; box.hidden = false; }
    throw new Error(body.error || r.statusText);
  }
  if (box) box.hidden = true;
  return body;
}

function fmtInt(n) { return n == null ? "—" : Number(n).toLocaleString("en-US"); }

function setText(id, value) { document.getElementById(id).textContent = value; }
