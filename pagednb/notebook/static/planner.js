// The memory planner: sliders for the workload and the what-ifs; Python answers with the plan
// (planner.py), so every number shown is the plain function's.

function h(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function slider(name, label, min, max, step, value, onInput) {
  const row = h("label", "pagednb-plan-row");
  const input = h("input");
  Object.assign(input, { type: "range", min, max, step, value });
  input.name = name;
  const shown = h("span", "pagednb-plan-value", String(value));
  input.addEventListener("input", () => { shown.textContent = input.value; onInput(name, Number(input.value)); });
  row.append(h("span", "pagednb-plan-label", label), input, shown);
  return row;
}

function render({ model, el }) {
  el.classList.add("pagednb-plan");
  const limits = model.get("limits");
  const start = model.get("settings");
  const controls = h("div", "pagednb-plan-controls");
  const answer = h("div", "pagednb-plan-answer");
  const details = h("pre", "pagednb-plan-details");
  el.append(controls, answer, details);

  let pending = null;
  function set(name, value) {
    // one message per animation frame at most, however fast the slider moves
    pending = { ...(pending || model.get("settings")), [name]: value };
    requestAnimationFrame(() => {
      if (!pending) return;
      model.set("settings", pending);
      model.save_changes();
      pending = null;
    });
  }
  const maxLen = limits.max_position_embeddings;
  controls.append(
    slider("prompt_tokens", "prompt tokens", 1, maxLen, 1, start.prompt_tokens, set),
    slider("output_tokens", "output tokens", 1, maxLen, 1, start.output_tokens, set),
    slider("users", "users", 1, limits.max_users, 1, start.users, set),
    slider("shared_prefix_tokens", "shared system prompt", 0, maxLen, 1, start.shared_prefix_tokens, set),
    slider("max_model_len", "max_model_len", 1, maxLen, 1, start.max_model_len, set),
    limits.on_gpu ? slider("gpu_memory_utilization", "gpu_memory_utilization", 0.05, 1, 0.01, start.gpu_memory_utilization, set)
      : slider("kv_cache_memory_mib", "kv_cache_memory (MiB)", 0.01, Math.max(65536, start.kv_cache_memory_mib), 0.01,
        start.kv_cache_memory_mib, set),
  );
  const dtypeRow = h("label", "pagednb-plan-row");
  const dtype = h("select");
  for (const name of ["float32", "bfloat16", "float16", "float8_e4m3fn"]) dtype.append(Object.assign(h("option", "", name), { value: name }));
  dtype.value = start.dtype;
  dtype.addEventListener("change", () => set("dtype", dtype.value));
  dtypeRow.append(h("span", "pagednb-plan-label", "KV dtype"), dtype);
  controls.append(dtypeRow);

  function draw() {
    const r = model.get("result") || {};
    if (r.error) {
      answer.className = "pagednb-plan-answer pagednb-plan-no";
      answer.textContent = r.error;
      details.textContent = "";
      return;
    }
    answer.className = "pagednb-plan-answer " + (r.fits ? "pagednb-plan-yes" : "pagednb-plan-no");
    answer.textContent = `${r.users} users ${r.fits ? "fit" : "do not fit"}: up to ${r.users_fit} ` +
      `(limited by ${r.limit}); ${r.users_fit_unshared} without sharing the system prompt`;
    details.textContent = r.text;
  }
  model.on("change:result", draw);
  draw();
  return () => model.off("change:result", draw);
}

export default { render };
