"""The trajectory viewer's inline stylesheet and script (written here, no CDN: the page must work
from ``file://`` with no network)."""

from __future__ import annotations

PAGE_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:8px 12px;background:#263238;color:#fff;display:flex;gap:16px;align-items:center;flex-wrap:wrap}
header h1{font-size:16px;margin:0}
header .muted{color:#cfd8dc}
.muted{color:#777}
.legend .tok{margin-right:4px}
#filters{padding:6px 12px;background:#eceff1;display:flex;gap:10px;flex-wrap:wrap;align-items:center}
#filters input[type=number]{width:70px}
main{display:flex;height:calc(100vh - 90px)}
#list{flex:0 0 520px;overflow:auto;border-right:1px solid #ccc}
#details{flex:1;overflow:auto;padding:0 12px}
table{border-collapse:collapse}
#traj-table{width:100%}
#traj-table th{position:sticky;top:0;background:#cfd8dc;cursor:pointer;padding:3px 5px;text-align:left}
#traj-table th.asc::after{content:" \\25B2"}
#traj-table th.desc::after{content:" \\25BC"}
#traj-table td{padding:2px 5px;border-bottom:1px solid #e0e0e0;white-space:nowrap}
#traj-table tr.traj-row{cursor:pointer}
#traj-table tr.traj-row:hover{background:#e3f2fd}
#traj-table tr.selected{background:#bbdefb}
#traj-table tr.failed td.c-failed{color:#c62828;font-weight:bold}
.facts{display:flex;flex-wrap:wrap;gap:6px 14px;margin-bottom:6px}
.verdict.bad{color:#c62828}.verdict.good{color:#2e7d32}
.stream{font:12px/1.9 ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;background:#fff;
  border:1px solid #ddd;padding:6px}
.tok{border-radius:2px;padding:0 1px;margin:0 1px 0 0;border-bottom:2px solid transparent}
.tok.gen{border-bottom-color:#1565c0;color:#0d47a1}
.tok.ctx{background:#fff3e0;border-bottom-color:#ef6c00;color:#6d4c41}
.tok.glue{background:#eeeeee;color:#9e9e9e}
.tok.prompt{background:#f3e5f5;color:#4a148c}
.tok.bad{background:#ffcdd2;color:#b71c1c;font-weight:bold}
.tok.img{background:#e0f2f1;color:#00695c;border-bottom-color:#00897b;font:11px sans-serif}
.tok.img.more{opacity:.75}
.thumb{display:inline-block;vertical-align:top;margin:4px 8px 2px 0}
.thumb img{display:block;max-width:128px;max-height:128px;border:1px solid #b0bec5;background:#fff}
.thumb figcaption{font-size:11px;color:#546e7a}
.thumb .no-thumb{display:inline-block;padding:8px;border:1px dashed #b0bec5;color:#777;font-size:11px}
.images-unplaced h4{margin:6px 0 2px}
.tok:hover{outline:1px solid #000}
#problems{padding:4px 12px;background:#ffebee;color:#b71c1c}
#problems ul{margin:2px 0;max-height:12em;overflow:auto}
.prompt-part{display:inline}
.prompt-part summary{display:inline-block;cursor:pointer;font:11px sans-serif;color:#4a148c}
.turn-sep{display:inline-block;font:10px sans-serif;color:#fff;background:#546e7a;border-radius:3px;
  padding:0 4px;margin:0 3px}
.segment{border-left:4px solid #90a4ae;padding-left:8px;margin:10px 0}
.messages .msg{border:1px solid #ddd;border-radius:4px;margin:4px 0;padding:4px 8px;background:#fff}
.msg .role{font-weight:bold;font-size:11px;text-transform:uppercase;color:#546e7a}
.msg.role-assistant{border-left:4px solid #1565c0}.msg.role-tool{border-left:4px solid #ef6c00}
.msg.role-user{border-left:4px solid #7b1fa2}.msg.role-system{border-left:4px solid #9e9e9e}
.msg pre{margin:2px 0;white-space:pre-wrap}
.tool-call{font-family:ui-monospace,monospace;background:#e3f2fd;padding:2px 4px;margin:2px 0}
.error{color:#c62828;white-space:pre-wrap}
.mismatch table td,.mismatch table th{border:1px solid #ddd;padding:1px 6px;font-family:ui-monospace,monospace}
.mismatch tr.diff{background:#ffebee}
.mismatch-note{color:#c62828}
.metrics td{padding:0 8px;border-bottom:1px solid #eee}
#tip{position:fixed;z-index:10;background:#263238;color:#fff;padding:3px 6px;border-radius:3px;font-size:12px;
  pointer-events:none}
"""

PAGE_JS = r"""
(function () {
  const rows = Array.from(document.querySelectorAll("#traj-table tbody tr.traj-row"));
  const tbody = document.querySelector("#traj-table tbody");
  const tip = document.getElementById("tip");
  const val = (id) => document.getElementById(id).value;
  const num = (id) => { const v = val(id); return v === "" ? null : Number(v); };

  function show(index) {
    document.querySelectorAll("section.detail").forEach((s) => { s.hidden = s.dataset.index !== String(index); });
    rows.forEach((r) => r.classList.toggle("selected", r.dataset.index === String(index)));
  }

  function applyFilters() {
    const group = val("f-group").trim(), failed = val("f-failed"), verdict = val("f-verdict");
    const rmin = num("f-reward-min"), rmax = num("f-reward-max"), lmin = num("f-length-min");
    const tmin = num("f-tools-min"), smin = num("f-segments-min");
    let shown = 0;
    rows.forEach((r) => {
      const d = r.dataset;
      const ok = (!group || d.group.includes(group)) && (failed === "" || d.failed === failed)
        && (rmin === null || Number(d.reward) >= rmin) && (rmax === null || Number(d.reward) <= rmax)
        && (lmin === null || Number(d.length) >= lmin) && (tmin === null || Number(d.tools) >= tmin)
        && (smin === null || Number(d.segments) >= smin) && (!verdict || d.verdict === verdict);
      r.hidden = !ok;
      shown += ok ? 1 : 0;
    });
    document.getElementById("count").textContent = shown + " of " + rows.length + " shown";
  }

  function sortBy(key, dir) {
    const numeric = rows.every((r) => r.dataset[key] !== "" && !isNaN(Number(r.dataset[key])));
    const sorted = rows.slice().sort((a, b) => {
      const x = a.dataset[key], y = b.dataset[key];
      const c = numeric ? Number(x) - Number(y) : x.localeCompare(y);
      return (dir === "asc" ? c : -c) || Number(a.dataset.index) - Number(b.dataset.index);
    });
    sorted.forEach((r) => tbody.appendChild(r));
    document.querySelectorAll("#traj-table th").forEach((th) => {
      th.classList.toggle("asc", th.dataset.key === key && dir === "asc");
      th.classList.toggle("desc", th.dataset.key === key && dir === "desc");
    });
  }

  function firstVisible() {
    const r = Array.from(tbody.children).find((x) => !x.hidden);
    if (r) show(r.dataset.index);
  }

  document.querySelectorAll("#traj-table th").forEach((th) => th.addEventListener("click", () => {
    sortBy(th.dataset.key, th.classList.contains("asc") ? "desc" : "asc");
  }));
  rows.forEach((r) => r.addEventListener("click", () => show(r.dataset.index)));
  document.querySelectorAll("#filters input, #filters select").forEach((el) => {
    el.addEventListener("input", applyFilters);
    el.addEventListener("change", applyFilters);
  });
  document.getElementById("worst").addEventListener("click", () => { sortBy("reward", "asc"); firstVisible(); });
  document.getElementById("best").addEventListener("click", () => { sortBy("reward", "desc"); firstVisible(); });

  document.addEventListener("mouseover", (ev) => {
    const t = ev.target.closest ? ev.target.closest(".tok[data-id]") : null;
    if (!t) { tip.hidden = true; return; }
    tip.textContent = t.getAttribute("title");
    tip.hidden = false;
  });
  document.addEventListener("mousemove", (ev) => {
    if (tip.hidden) return;
    // Kept inside the window: a token at the right edge would push its tooltip off screen.
    tip.style.left = Math.max(0, Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 4)) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  });

  applyFilters();
  if (rows.length) show(rows[0].dataset.index);
})();
"""
