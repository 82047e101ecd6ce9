// Learn pages' helpers: layout and drawing only; every number comes from /api/learn/...
"use strict";

function field(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function fmt(v, digits) {
  if (v == null) return "—";
  if (typeof v !== "number") return String(v);
  if (digits === "int") return fmtInt(v);
  if (digits === "g") return (v / 1e9).toFixed(4);
  return v.toFixed(digits == null ? 4 : Number(digits));
}

function $(id) { return document.getElementById(id); }

function val(id) { return $(id).value; }

// <span data-api="/api/...?a=1" data-field="x.y" data-digits="3"> filled from the endpoint
async function fillApi(root) {
  const spans = (root || document).querySelectorAll("[data-api]");
  const cache = {};
  for (const el of spans) {
    const url = el.dataset.api;
    cache[url] = cache[url] || api(url);
    const body = await cache[url];
    el.textContent = fmt(field(body, el.dataset.field), el.dataset.digits);
  }
}

function table(el, columns, rows, cls) {
  const head = "<tr>" + columns.map(c => `<th>${c}</th>`).join("") + "</tr>";
  const body = rows.map(r => "<tr>" + r.map((c, i) =>
    `<td class="${cls && cls[i] ? cls[i] : ""}">${c}</td>`).join("") + "</tr>").join("");
  el.innerHTML = `<table>${head}${body}</table>`;
}

const PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2",
                 "#ff9da6", "#9d755d", "#bab0ac"];

// A [rows][cols] grid as SVG; color(v, r, c) -> fill or "hatch"; text(v, r, c) -> label
function svgGrid(el, grid, color, opts) {
  opts = opts || {};
  const rows = grid.length, cols = rows ? grid[0].length : 0;
  const w = opts.cell || Math.max(3, Math.min(26, Math.floor((opts.width || 300) / Math.max(cols, 1))));
  const h = opts.cellH || w;
  const left = opts.left || 0;
  let s = `<svg width="${left + cols * w + 2}" height="${rows * h + 2}" class="grid">` +
    `<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" ` +
    `patternTransform="rotate(45)"><rect width="6" height="6" fill="#eee"/>` +
    `<line x1="0" y1="0" x2="0" y2="6" stroke="#888" stroke-width="2"/></pattern></defs>`;
  for (let r = 0; r < rows; r++) {
    if (opts.rowLabel) s += `<text x="0" y="${r * h + h * 0.75}" font-size="${Math.min(12, h)}">${opts.rowLabel(r)}</text>`;
    for (let c = 0; c < cols; c++) {
      const v = grid[r][c], f = color(v, r, c);
      s += `<rect x="${left + c * w + 1}" y="${r * h + 1}" width="${w - 1}" height="${h - 1}" ` +
        `fill="${f === "hatch" ? "url(#hatch)" : f}" data-r="${r}" data-c="${c}"/>`;
      if (opts.text && w >= 12) {
        s += `<text x="${left + c * w + w / 2}" y="${r * h + h * 0.7}" font-size="${Math.min(11, w * 0.6)}" ` +
          `text-anchor="middle">${opts.text(v, r, c)}</text>`;
      }
    }
  }
  el.innerHTML = s + "</svg>";
}

// Re-run `fn` when any of the inputs changes (debounced for sliders and typing)
function onInputs(ids, fn) {
  let timer = null;
  const run = () => { clearTimeout(timer); timer = setTimeout(() => fn().catch(() => {}), 120); };
  for (const id of ids) {
    $(id).addEventListener("input", run);
    $(id).addEventListener("change", run);
  }
  return fn().catch(() => {});
}
