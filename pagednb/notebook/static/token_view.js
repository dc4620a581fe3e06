// The token view: a reply drawn token by token, each coloured by the probability the model gave it;
// hovering a token shows the top-k alternatives at that position. Rows come from Python (token_view.py)
// as [text, probability, rank, [[text, probability, rank], ...]] in custom messages {start, rows}: a
// reply only grows, so each message carries only the new tokens and the view appends their spans. A
// view asks for all the rows when it is drawn, and again if it ever sees a gap.

function colour(p) {
  // red (unlikely) through yellow to green (near certain); light enough to read black text on
  return `hsl(${Math.round(120 * p)}, 80%, ${Math.round(78 + 8 * p)}%)`;
}

function visible(text) {
  // whitespace made visible in the tooltip, where a bare space or newline would look empty
  return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u2423") || "\u2205";
}

function percent(p) {
  return p >= 0.001 ? `${(100 * p).toFixed(1)}%` : "<0.1%";
}

function tooltip(row) {
  const [text, p, chosenRank, alternatives] = row;
  const tip = document.createElement("div");
  const head = document.createElement("div");
  head.className = "pagednb-token-tip-head";
  head.textContent = `${visible(text)}  ${percent(p)}  (rank ${chosenRank})`;
  tip.append(head);
  const table = document.createElement("table");
  for (const [alt, q, rank] of alternatives) {
    const tr = table.insertRow();
    if (rank === chosenRank) tr.className = "pagednb-token-chosen";
    tr.insertCell().textContent = `${rank}.`;
    tr.insertCell().textContent = visible(alt);
    const bar = tr.insertCell();
    const fill = document.createElement("span");
    fill.className = "pagednb-token-bar";
    fill.style.width = `${Math.max(1, Math.round(60 * q))}px`;
    fill.style.background = colour(q);
    bar.append(fill);
    tr.insertCell().textContent = percent(q);
  }
  tip.append(table);
  return tip;
}

function render({ model, el }) {
  el.classList.add("pagednb-tokens");
  const box = document.createElement("div");
  box.className = "pagednb-tokens-text";
  const legend = document.createElement("div");
  legend.className = "pagednb-tokens-legend";
  legend.innerHTML = 'token probability: <span style="background:' + colour(0) + '">low</span> ' +
    '<span style="background:' + colour(0.5) + '">50%</span> <span style="background:' + colour(1) +
    '">high</span> · hover a token for the alternatives';
  const tip = document.createElement("div");
  tip.className = "pagednb-token-tip";
  tip.hidden = true;
  el.append(box, legend, tip);

  const rows = [];
  let drawn = 0;
  function draw(from) {
    while (drawn > from) {  // rows replaced from `from` on (the full set after a request): redraw those
      box.lastChild.remove();
      drawn--;
    }
    const spans = document.createDocumentFragment();
    for (let i = drawn; i < rows.length; i++) {
      const span = document.createElement("span");
      span.className = "pagednb-token";
      span.dataset.index = String(i);
      span.textContent = rows[i][0];
      span.style.background = colour(rows[i][1]);
      spans.append(span);
    }
    box.append(spans);
    drawn = rows.length;
  }
  function style() {
    box.style.cssText = model.get("box_css");
  }
  function show(event) {
    const span = event.target.closest(".pagednb-token");
    if (!span) return;
    const row = rows[Number(span.dataset.index)];
    if (!row) return;
    tip.replaceChildren(tooltip(row));
    // fixed to the viewport: a scrolling ancestor (the chat history) would clip an absolute tooltip
    const at = span.getBoundingClientRect();
    tip.style.left = `${at.left}px`;
    tip.style.top = `${at.bottom + 4}px`;
    tip.hidden = false;
    const room = window.innerHeight - tip.getBoundingClientRect().bottom;
    if (room < 0) tip.style.top = `${at.top - tip.offsetHeight - 4}px`;  // no room below: above the token
  }
  box.addEventListener("mouseover", show);
  const hide = () => { tip.hidden = true; };
  box.addEventListener("mouseleave", hide);
  window.addEventListener("scroll", hide, { capture: true, passive: true });
  function receive(message) {
    if (!Array.isArray(message.rows)) return;
    if (message.start > rows.length) {  // a gap: this view missed a message
      model.send({ want: "all" });
      return;
    }
    rows.splice(message.start, rows.length - message.start, ...message.rows);
    draw(message.start);
  }
  model.on("msg:custom", receive);
  model.on("change:box_css", style);
  style();
  model.send({ want: "all" });
  return () => {
    window.removeEventListener("scroll", hide, { capture: true });
    model.off("msg:custom", receive);
    model.off("change:box_css", style);
  };
}

export default { render };
