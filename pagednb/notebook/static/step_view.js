// The step debugger: buttons that drive the engine (Python does the work: step_view.py) and the last
// step's report drawn as tables — the batch, the budget, blocks, preemptions, waiting requests, block
// tables. `report` is a StepReport as JSON (engine/step_report.py), `status` the engine's state.

function h(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function meter(label, used, total, cls) {
  const box = h("div", "pagednb-step-meter " + cls);
  const bar = h("div", "pagednb-step-meter-bar");
  const fill = h("div", "pagednb-step-meter-fill");
  fill.style.width = `${total ? Math.min(100, (100 * used) / total) : 0}%`;
  bar.append(fill);
  box.append(h("span", "pagednb-step-meter-label", `${label} ${used} of ${total}`), bar);
  return box;
}

function table(className, headers, rows) {
  const t = h("table", "pagednb-step-table " + className);
  const head = t.createTHead().insertRow();
  for (const name of headers) head.append(h("th", "", name));
  const body = t.createTBody();
  for (const cells of rows) {
    const tr = body.insertRow();
    for (const cell of cells) {
      const td = tr.insertCell();
      if (cell instanceof Node) td.append(cell);
      else td.textContent = cell;
    }
  }
  return t;
}

function chips(ids, fresh) {
  const box = h("span", "pagednb-step-chips");
  for (const id of ids) box.append(h("span", fresh.has(id) ? "pagednb-step-chip pagednb-step-new" : "pagednb-step-chip", id));
  return box;
}

function section(title, content) {
  const box = h("div", "pagednb-step-section");
  box.append(h("div", "pagednb-step-title", title), content);
  return box;
}

function label(report, rid) {
  const text = (report.labels || {})[rid];
  return text ? `${rid}  “${text}”` : rid;
}

function drawReport(report) {
  const box = h("div", "pagednb-step-report");
  if (!report || report.step === undefined) {
    box.append(h("div", "pagednb-step-empty", "No step yet: add requests, then press Step."));
    return box;
  }
  box.append(h("div", "pagednb-step-summary", report.summary));
  const meters = h("div", "pagednb-step-meters");
  meters.append(
    meter("tokens", report.num_batched_tokens, report.max_num_batched_tokens, "pagednb-step-budget"),
    meter("seqs", report.num_running, report.max_num_seqs, "pagednb-step-seqs"),
  );
  box.append(meters);
  const fresh = new Set();
  for (const row of report.rows) for (const id of row.new_block_ids) fresh.add(id);
  const rows = report.rows.map((r) => [
    label(report, r.request_id), r.kind, `${r.start}–${r.start + r.num_tokens}`, String(r.num_tokens),
    r.cached_tokens ? String(r.cached_tokens) : "", chips(r.new_block_ids, fresh), r.samples ? "yes" : "no",
  ]);
  box.append(section(`Batch: ${report.rows.length} rows, ${report.num_batched_tokens} tokens`,
    rows.length ? table("pagednb-step-batch", ["request", "kind", "tokens", "n", "cache hit", "new blocks", "samples"], rows)
      : h("div", "pagednb-step-empty", "nothing scheduled")));
  const b = report.pool_before, a = report.pool_after;
  box.append(section("Blocks", h("div", "pagednb-step-blocks",
    `+${report.blocks_allocated} allocated · ${report.blocks_hit} prefix-cache hits · -${report.blocks_freed} freed · ` +
    `pool: used ${b.used} → ${a.used}, free ${b.free} → ${a.free}, holding cached prefixes ${a.cached}`)));
  if (report.preemptions.length) {
    box.append(section("Preemptions", table("pagednb-step-preemptions", ["request", "why", "blocks freed"],
      report.preemptions.map((p) => [label(report, p.request_id), p.reason, String(p.blocks_freed)]))));
  }
  if (report.waiting.length) {
    box.append(section(`Waiting: ${report.waiting.length}`, h("div", "pagednb-step-waiting",
      `${report.waiting.join(", ")} — ${report.waiting_reason}`)));
  }
  if (report.finished.length) {
    box.append(section("Finished this step", h("div", "pagednb-step-finished",
      report.finished.map(([rid, reason]) => `${rid} (${reason})`).join(", "))));
  }
  const tables = Object.entries(report.block_tables);
  if (tables.length) {
    box.append(section("Block tables (new blocks highlighted)", table("pagednb-step-tables", ["request", "blocks"],
      tables.map(([rid, ids]) => [label(report, rid), chips(ids, fresh)]))));
  }
  return box;
}

function drawFinished(finished) {
  if (!finished || !finished.length) return h("div");
  return section("Your requests, finished", table("pagednb-step-done", ["request", "reason", "text"],
    finished.map((f) => [f.request_id, f.reason, f.text])));
}

function render({ model, el }) {
  el.classList.add("pagednb-step");
  const bar = h("div", "pagednb-step-bar");
  const step = h("button", "pagednb-step-step", "Step");
  const run = h("button", "pagednb-step-run", "Run");
  const prompt = h("input", "pagednb-step-prompt");
  prompt.placeholder = "a prompt to queue";
  const add = h("button", "pagednb-step-add", "Add");
  const state = h("span", "pagednb-step-state");
  bar.append(step, run, prompt, add, state);
  const message = h("div", "pagednb-step-message");
  const body = h("div", "pagednb-step-body");
  const done = h("div", "pagednb-step-done-box");
  el.append(bar, message, body, done);

  step.addEventListener("click", () => model.send({ action: "step" }));
  run.addEventListener("click", () => model.send({ action: model.get("status").paused ? "run" : "pause" }));
  function submit() {
    if (!prompt.value.trim()) return;
    model.send({ action: "add", prompt: prompt.value });
    prompt.value = "";
  }
  add.addEventListener("click", submit);
  prompt.addEventListener("keydown", (event) => { if (event.key === "Enter") submit(); });

  function drawStatus() {
    const s = model.get("status") || {};
    run.textContent = s.paused ? "Run" : "Pause";
    state.textContent = `${s.paused ? "paused" : "running"} · running ${s.running ?? 0} · waiting ${s.waiting ?? 0} · ` +
      `blocks used ${s.used_blocks ?? 0} of ${s.num_blocks ?? 0}`;
    state.className = "pagednb-step-state " + (s.paused ? "pagednb-step-paused" : "pagednb-step-running");
    message.textContent = s.message || "";
    done.replaceChildren(drawFinished(s.finished));
  }
  function drawBody() {
    body.replaceChildren(drawReport(model.get("report")));
  }
  model.on("change:status", drawStatus);
  model.on("change:report", drawBody);
  drawStatus();
  drawBody();
  return () => {
    model.off("change:status", drawStatus);
    model.off("change:report", drawBody);
  };
}

export default { render };
