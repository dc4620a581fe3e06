// The prefix cache as a tree: each node one cached block (hover for its token text), its ref count and
// its place in the eviction order among the cached blocks (1 = the first to go; none while a request
// holds it). Nodes come parents first as [id, parent, text, ref_cnt, eviction_order, reachable]
// (prefix_tree.py).

function h(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function visible(text) {
  return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function nodeBox([id, , text, refs, rank, reachable]) {
  const cls = refs > 0 ? "pagednb-tree-used" : reachable ? "pagednb-tree-cached" : "pagednb-tree-stale";
  const box = h("span", "pagednb-tree-node " + cls);
  box.dataset.block = id;
  box.title = `block ${id}: “${visible(text)}”\n` + (refs > 0 ? `held by ${refs} request${refs > 1 ? "s" : ""}` :
    `free, kept for reuse: cached block number ${rank} to be evicted`) +
    (reachable ? "" : "\nunreachable: a block before it was evicted");
  box.append(h("span", "pagednb-tree-id", `#${id}`), h("span", "pagednb-tree-text", visible(text).slice(0, 24)),
    h("span", "pagednb-tree-meta", refs > 0 ? `ref ${refs}` : `evict ${rank}`));
  return box;
}

function render({ model, el }) {
  el.classList.add("pagednb-tree");
  const head = h("div", "pagednb-tree-head");
  const legend = h("div", "pagednb-tree-legend");
  legend.innerHTML = '<span class="pagednb-tree-node pagednb-tree-used">in use</span> ' +
    '<span class="pagednb-tree-node pagednb-tree-cached">cached, free</span> ' +
    '<span class="pagednb-tree-node pagednb-tree-stale">unreachable</span> · hover a block for its text';
  const body = h("div", "pagednb-tree-body");
  el.append(head, legend, body);

  function draw() {
    const tree = model.get("tree") || {};
    const nodes = tree.nodes || [];
    head.textContent = `${tree.num_cached ?? 0} cached blocks of ${tree.block_size ?? "?"} tokens` +
      (tree.shown < tree.num_cached ? ` (the ${tree.shown} nearest the roots shown)` : "") +
      ` · pool: ${tree.num_free ?? 0} free of ${tree.num_blocks ?? 0}`;
    const items = new Map();
    const roots = h("ul", "pagednb-tree-list");
    for (const node of nodes) {
      const li = h("li");
      li.append(nodeBox(node));
      items.set(node[0], li);
      const parent = node[1] === null ? undefined : items.get(node[1]);
      if (parent === undefined) {
        roots.append(li);
      } else {
        let list = parent.querySelector(":scope > ul");
        if (!list) { list = h("ul", "pagednb-tree-list"); parent.append(list); }
        list.append(li);
      }
    }
    body.replaceChildren(nodes.length ? roots : h("div", "pagednb-tree-empty", "The prefix cache is empty."));
  }
  model.on("change:tree", draw);
  draw();
  return () => model.off("change:tree", draw);
}

export default { render };
