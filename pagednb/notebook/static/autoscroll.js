// Keeps a scrolling box (the chat history) at its bottom as content arrives, the way a chat app does:
// a new message always scrolls into view; a streaming reply keeps it pinned to the bottom unless the
// user has scrolled up to read, and scrolling back down pins it again. The box is found by its class
// inside the nearest ancestor with `container` class (the chat), once this element is in the page.

function follow(box) {
  let pinned = true;
  const atBottom = () => box.scrollHeight - box.scrollTop - box.clientHeight < 30;
  const toBottom = () => { box.scrollTop = box.scrollHeight; };
  box.addEventListener("scroll", () => { pinned = atBottom(); });
  const observer = new MutationObserver((records) => {
    if (records.some((r) => r.target === box && r.addedNodes.length)) pinned = true;  // a new message
    if (pinned) toBottom();
  });
  observer.observe(box, { childList: true, subtree: true, characterData: true });
  toBottom();
  return observer;
}

function render({ model, el }) {
  el.style.display = "none";
  let observer = null;
  let tries = 0;
  // ipywidgets may render this view before it is attached to the page: look until it is
  const timer = setInterval(() => {
    const container = el.closest("." + model.get("container"));
    const box = container && container.querySelector("." + model.get("target"));
    if (box) observer = follow(box);
    if (box || ++tries > 300) clearInterval(timer);
  }, 100);
  return () => {
    clearInterval(timer);
    if (observer) observer.disconnect();
  };
}

export default { render };
