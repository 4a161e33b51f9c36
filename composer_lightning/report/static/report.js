// The run report's page: draws the embedded run data (report/page.py) with plotly.js.
// No network: plotly.js is in the page, gzip-compressed (unpacked here) or plain.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const STATE_KEY = "composer-report-state";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "style") Object.assign(node.style, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const fmt = (v, d = 3) => (v === null || v === undefined ? "—" : Number(v).toPrecision(d));

  async function loadPlotly() {
    if (window.Plotly) return;
    const packed = document.getElementById("plotly-gz");
    if (!packed) throw new Error("plotly.js is not in this page");
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot unpack the embedded plotly.js (no DecompressionStream): " +
        "write the report with `report RUN_DIR --plain-js`");
    }
    const raw = atob(packed.textContent.trim());
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    const script = document.createElement("script");
    script.textContent = await new Response(stream).text();
    document.head.appendChild(script);
  }

  // ---------------------------------------------------------------- at a glance
  function glance() {
    const run = DATA.run, body = document.getElementById("glance-body");
    const heads = run.heads.map((h) => `${h.name} × ${fmt(h.weight)}`).join(", ") || "—";
    body.append(el("p", { class: "muted" },
      `${run.run_dir} · policy ${run.policy || "—"} · heads ${heads} · last logged step ` +
      `${run.last_step ?? "—"} · written ${run.written}`));
    const cards = el("div", { class: "cards" });
    for (const [label, g] of Object.entries(run.glance)) {
      cards.append(el("div", { class: "card" }, el("div", { class: "muted" }, label),
        el("div", { class: "big" }, `${fmt(g.first[1])} → ${fmt(g.last[1])}`),
        el("div", { class: "muted" }, `step ${g.first[0]} → ${g.last[0]}`)));
    }
    body.append(cards);
    const events = DATA.collapse;
    body.append(el("h3", {}, "Where the run went wrong"));
    body.append(events.length
      ? el("ul", { class: "events" }, events.map((e) => el("li", {}, `step ${e.step}: ${e.line}`)))
      : el("p", { class: "muted" }, "CollapseWatch saw no collapse (held-out accuracy, reply " +
        "length, truncation and tool calls all held)."));
    const table = DATA.heldout;
    if (table.steps.length) {
      const first = String(table.steps[0]), last = String(table.steps[table.steps.length - 1]);
      body.append(el("h3", {}, `What the policy says now (held-out, greedy) — after ${first} ` +
        `and after ${last} steps`));
      const list = el("ul", {});
      const reply = (p, s) => (p.at[s] ? p.at[s].reply : null);
      const changed = table.problems.filter((p) => reply(p, first) !== reply(p, last));
      const same = table.problems.filter((p) => reply(p, first) === reply(p, last));
      for (const p of changed.concat(same).slice(0, 4)) {  // what changed first
        const a = p.at[first], b = p.at[last];
        list.append(el("li", {}, el("span", { class: "text" }, p.prompt), " → ",
          verdictBadge(a && a.solved, a ? a.reward : null), " ", el("span", { class: "text" }, a ? a.reply : "—"),
          " ⟶ ", verdictBadge(b && b.solved, b ? b.reward : null), " ",
          el("span", { class: "text" }, b ? b.reply : "—")));
      }
      body.append(list);
    }
  }

  // ---------------------------------------------------------------- curves
  function curves() {
    const grid = document.getElementById("curve-grid");
    for (const f of DATA.figures) {
      if (!f.figure) {
        grid.append(el("div", { class: "panel missing", "data-panel": f.key },
          el("h3", {}, f.title), f.missing));
        continue;
      }
      const div = el("div", { class: "panel", id: `curve-${f.key}`, "data-panel": f.key });
      grid.append(div);
      window.Plotly.newPlot(div, f.figure.data, f.figure.layout,
        { displaylogo: false, displayModeBar: false, responsive: true });
    }
  }

  // ---------------------------------------------------------------- rollouts
  const rows = DATA.rollouts.slice().reverse();  // the newest first: what the policy says now
  const names = DATA.token_values;
  const scales = {};  // each value's 95th percentile of |value|: a common colour scale
  for (const name of names) {
    const all = [];
    for (const r of rows) {
      const v = r.details && r.details.values && r.details.values[name];
      if (v) for (const x of v) if (x !== null && x !== 0) all.push(Math.abs(x));
    }
    all.sort((a, b) => a - b);
    scales[name] = all.length ? all[Math.min(all.length - 1, Math.floor(all.length * 0.95))] : 1;
  }
  const ui = Object.assign({ search: "", step: "all", signal: "all",
    colour: names[0] || "none" },  // `mixed` where the rows have weights: what the surrogate trains
  JSON.parse(sessionStorage.getItem(STATE_KEY) || "{}"));
  if (ui.colour !== "none" && !names.includes(ui.colour)) ui.colour = names[0] || "none";

  function tokenColour(name, x) {
    if (x === null || x === undefined || x === 0) return "rgba(0, 0, 0, 0)";
    const t = Math.min(1, Math.abs(x) / (scales[name] || 1));
    const alpha = (0.12 + 0.78 * t).toFixed(3);
    if (name.includes("/")) return `rgba(230, 126, 34, ${alpha})`;  // a divergence: >= 0
    return x > 0 ? `rgba(39, 174, 96, ${alpha})` : `rgba(192, 57, 43, ${alpha})`;
  }

  function verdictBadge(ok, reward) {
    if (reward === null || reward === undefined) return el("span", { class: "badge" }, "no score");
    return el("span", { class: `badge ${ok ? "ok" : "bad"}` }, `${ok ? "✓" : "✗"} ${fmt(reward)}`);
  }

  function tokensView(row) {
    const d = row.details, name = ui.colour;
    const values = name !== "none" && d.values ? d.values[name] : null;
    const wrap = el("span", { class: "tokens" });
    d.tokens.forEach((tok, i) => {
      const lines = [`token ${JSON.stringify(tok)}`];
      for (const n of names) if (d.values[n]) lines.push(`${n}: ${fmt(d.values[n][i], 4)}`);
      lines.push(`student log-prob: ${fmt(d.student_logprobs && d.student_logprobs[i], 4)}`);
      if (d.teacher_logprobs) lines.push(`hinted teacher log-prob: ${fmt(d.teacher_logprobs[i], 4)}`);
      const span = el("span", { class: "tok", title: lines.join("\n") }, tok);
      span.style.backgroundColor = values ? tokenColour(name, values[i]) : "rgba(0, 0, 0, 0)";
      wrap.append(span);
    });
    const note = values && values.every((x) => !x)
      ? el("span", { class: "muted" }, `  (${name}: 0 on every token of this reply)`) : null;
    return [wrap, note];
  }

  function messageView(row) {
    const signals = row.signal || [];
    let turn = 0;
    return row.messages.map((m) => {
      const parts = [el("b", {}, m.role)];
      if (m.role === "assistant") {
        parts.push(" ", verdictBadge(m.reward !== null && m.reward >= 1, m.reward));
        if (signals[turn]) parts.push(" ", el("span", { class: `badge sig-${signals[turn]}` },
          DATA.signals[signals[turn]] || signals[turn]));
        turn += 1;
      }
      const box = el("div", { class: `msg ${m.role}` }, parts, el("div", { class: "text" }, m.content));
      if (m.hint) box.append(el("div", {}, el("b", {}, "next-state hint: "), el("span", { class: "hint" }, m.hint)));
      return box;
    });
  }

  function rolloutCard(row) {
    const signal = (row.signal || [])[0];
    const head = el("div", { class: "head" }, el("span", { class: "badge" }, `step ${row.step}`),
      signal ? el("span", { class: `badge sig-${signal}` }, DATA.signals[signal] || signal) : null,
      row.messages ? el("span", { class: "badge" }, `episode · ${row.status || ""}`) : null,
      verdictBadge(row.reward !== null && row.reward >= 1, row.reward));
    const card = el("div", { class: "rollout", "data-step": row.step }, head);
    if (row.messages) {
      card.append(...messageView(row));
      return card;
    }
    card.append(el("div", { class: "field" }, el("b", {}, "prompt"), el("span", { class: "text" }, row.prompt)));
    if (row.hint) card.append(el("div", { class: "field" }, el("b", {}, "hint"), el("span", { class: "hint text" }, row.hint)));
    const reply = row.details ? tokensView(row) : [el("span", { class: "text" }, row.completion)];
    card.append(el("div", { class: "field" }, el("b", {}, "reply"), ...reply));
    if (row.teacher_reply !== undefined) {
      const told = row.teacher_hint && row.teacher_hint !== row.hint
        ? [el("span", { class: "muted" }, " told "), el("span", { class: "hint text" }, row.teacher_hint),
          el("span", { class: "muted" }, " (another sample's hint in this group)")] : [];
      card.append(el("div", { class: "field" }, el("b", {}, "hinted teacher"),
        verdictBadge(row.teacher_reward !== null && row.teacher_reward >= 1, row.teacher_reward), " ",
        el("span", { class: "text" }, row.teacher_reply), ...told));
    }
    if (row.hinted_reply !== undefined) {
      card.append(el("div", { class: "field" }, el("b", {}, "hinted reply"),
        verdictBadge(row.hinted_reward !== null && row.hinted_reward >= 1, row.hinted_reward), " ",
        el("span", { class: "text" }, row.hinted_reply)));
    }
    if (row.details && row.details.weights) {
      const w = Object.entries(row.details.weights).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ");
      card.append(el("div", { class: "field muted" }, el("b", {}, "head weights"), w));
    }
    return card;
  }

  function searchable(row) {
    const parts = [row.prompt, row.completion, row.hint, row.teacher_reply, row.hinted_reply];
    for (const m of row.messages || []) parts.push(m.content, m.hint);
    return parts.filter((p) => p).join("\n").toLowerCase();
  }
  const haystacks = rows.map(searchable);

  function renderRollouts() {
    sessionStorage.setItem(STATE_KEY, JSON.stringify(ui));
    const list = document.getElementById("rollout-list");
    list.replaceChildren();
    const q = ui.search.toLowerCase();
    const shown = rows.filter((r, i) => (ui.step === "all" || String(r.step) === ui.step) &&
      (ui.signal === "all" || (r.signal || []).includes(ui.signal)) && (!q || haystacks[i].includes(q)));
    const limit = 200;
    shown.slice(0, limit).forEach((r) => list.append(rolloutCard(r)));
    const kept = DATA.kept.rollouts || [0, 0];
    document.getElementById("rollout-count").textContent =
      `${Math.min(shown.length, limit)} of ${shown.length} matching rows shown; the report holds ` +
      `${rows.length} rows (${kept[0]} of ${kept[1]} sample rows in rollouts.jsonl, sampled by step).`;
    const legend = document.getElementById("token-legend");
    if (!names.length) {
      legend.textContent = "No per-token details in this run: add composer_lightning.report.TokenDetails " +
        "to trainer.callbacks to colour each reply's tokens by each head's push.";
    } else if (ui.colour === "none") {
      legend.textContent = "Tokens uncoloured.";
    } else if (ui.colour.includes("/")) {
      legend.replaceChildren(el("span", { class: "swatch", style: { background: "rgba(230,126,34,.8)" } }),
        ` ${ui.colour} per token (darker: larger; scale ${fmt(scales[ui.colour])}). Hover a token for every value.`);
    } else {
      const what = ui.colour === "mixed"
        ? "by all advantage heads together (mixed: Σ weight × advantage, what the surrogate trains on)"
        : `by ${ui.colour}'s advantage alone`;
      legend.replaceChildren(el("span", { class: "swatch", style: { background: "rgba(39,174,96,.8)" } }),
        " pushed up  ",
        el("span", { class: "swatch", style: { background: "rgba(192,57,43,.8)" } }),
        ` pushed down, ${what}; scale ±${fmt(scales[ui.colour])}. Hover a token for every value.`);
    }
  }

  function rolloutControls() {
    const search = document.getElementById("search");
    search.value = ui.search;
    search.addEventListener("input", () => { ui.search = search.value; renderRollouts(); });
    const steps = [...new Set(rows.map((r) => r.step))];
    const stepSel = document.getElementById("step-filter");
    stepSel.append(el("option", { value: "all" }, "all"), ...steps.map((s) => el("option", { value: String(s) }, String(s))));
    stepSel.value = steps.map(String).includes(ui.step) ? ui.step : "all";
    ui.step = stepSel.value;
    stepSel.addEventListener("change", () => { ui.step = stepSel.value; renderRollouts(); });
    const sigSel = document.getElementById("signal-filter");
    sigSel.append(el("option", { value: "all" }, "all"),
      ...Object.entries(DATA.signals).map(([k, v]) => el("option", { value: k }, v)));
    sigSel.value = ui.signal;
    sigSel.addEventListener("change", () => { ui.signal = sigSel.value; renderRollouts(); });
    const group = document.getElementById("colour-by");
    if (names.length) group.append(el("b", {}, "colour tokens by: "));
    for (const name of names.concat(names.length ? ["none"] : [])) {
      const input = el("input", { type: "radio", name: "colour", value: name, checked: name === ui.colour });
      input.addEventListener("change", () => { ui.colour = name; renderRollouts(); });
      group.append(el("label", {}, input, ` ${name}`));
    }
  }

  // ---------------------------------------------------------------- held-out
  function heldout() {
    const body = document.getElementById("heldout-body"), t = DATA.heldout;
    if (!t.steps.length) {
      body.append(el("p", { class: "muted" }, "No held-out replies in this run (heldout.jsonl is written " +
        "at each evaluation: trainer.val_check_interval, rollout.val_before_train)."));
      return;
    }
    const kept = DATA.kept.heldout || [0, 0];
    body.append(el("p", { class: "muted" }, `The greedy reply to the same ${t.problems.length} held-out ` +
      `problems after each evaluation (green: solved; a blue edge: changed since the column before; ` +
      `${kept[0]} of ${kept[1]} rows).`));
    const header = el("tr", {}, el("th", {}, "problem"), t.steps.map((s) => el("th", {}, `after ${s} steps`)));
    const acc = el("tr", {}, el("td", { class: "muted" }, "solved here"), t.steps.map((s) => {
      const cells = t.problems.map((p) => p.at[String(s)]).filter((c) => c);
      return el("td", { class: "muted" }, `${cells.filter((c) => c.solved).length} / ${cells.length}`);
    }));
    const lines = t.problems.map((p) => {
      let before = null;
      return el("tr", {}, el("td", { class: "text" }, p.prompt), t.steps.map((s) => {
        const c = p.at[String(s)];
        if (!c) return el("td", { class: "muted" }, "—");
        const changed = before !== null && before !== c.reply;
        before = c.reply;
        return el("td", { class: `text ${c.solved ? "solved" : "unsolved"}${changed ? " changed" : ""}` }, c.reply);
      }));
    });
    body.append(el("div", { class: "scroll" }, el("table", {}, el("thead", {}, header), el("tbody", {}, acc, lines))));
  }

  // ---------------------------------------------------------------- served turns
  function served() {
    const body = document.getElementById("served-body"), turns = DATA.turns;
    if (!turns.length) {
      body.append(el("p", { class: "muted" }, "Not a serve run (no turns.sqlite beside it)."));
      return;
    }
    const latest = Math.max(...turns.map((t) => t.version || 0));
    const kept = DATA.kept.turns || [0, 0];
    body.append(el("p", { class: "muted" }, `${kept[0]} of ${kept[1]} served turns, by session; ` +
      `staleness: versions between the turn's weights and the latest (${latest}). The judge's ` +
      `verdict is its majority over its votes; single votes are not stored.`));
    const sessions = {};
    for (const t of turns) (sessions[t.session] = sessions[t.session] || []).push(t);
    const header = el("tr", {}, ["session", "turn", "version", "staleness", "state", "verdict", "hint",
      "prompt", "reply"].map((h) => el("th", {}, h)));
    const lines = [];
    for (const [session, list] of Object.entries(sessions)) {
      list.sort((a, b) => a.turn_index - b.turn_index);
      for (const t of list) {
        lines.push(el("tr", {}, el("td", {}, session), el("td", {}, t.turn_index), el("td", {}, t.version),
          el("td", {}, latest - (t.version || 0)), el("td", {}, t.state + (t.drop_reason ? ` (${t.drop_reason})` : "")),
          el("td", {}, verdictBadge(t.reward !== null && t.reward >= 1, t.reward)),
          el("td", { class: "text" }, t.hint || ""), el("td", { class: "text" }, t.prompt),
          el("td", { class: "text" }, t.reply)));
      }
    }
    body.append(el("div", { class: "scroll" }, el("table", {}, el("thead", {}, header), el("tbody", {}, lines))));
  }

  function files() {
    const kept = Object.entries(DATA.kept).map(([k, [a, b]]) => `${k}: ${a} of ${b}`).join(" · ");
    document.getElementById("files-body").append(
      el("p", {}, DATA.files.length ? DATA.files.join(", ") : "none"),
      el("p", { class: "muted" }, `Rows shown: ${kept}. TensorBoard has every scalar.`));
  }

  function watchForChanges() {
    if (!DATA.refresh_s) return;
    setInterval(async () => {  // DATA.stamp: the run's files as this page was written from them
      try {
        const stamp = await (await fetch("stamp", { cache: "no-store" })).text();
        if (stamp !== DATA.stamp) location.reload();
      } catch (e) { /* the server stopped: keep the page as it is */ }
    }, DATA.refresh_s * 1000);
  }

  async function main() {
    glance();
    rolloutControls();
    renderRollouts();
    heldout();
    served();
    files();
    watchForChanges();
    try {
      await loadPlotly();
      curves();
    } catch (e) {
      const banner = document.getElementById("banner");
      banner.hidden = false;
      banner.textContent = `The curves could not be drawn: ${e.message}`;
      document.body.dataset.error = e.message;
      throw e;
    }
    document.body.dataset.ready = "1";
  }
  main();
})();
