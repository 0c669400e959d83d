// The overview's live counters, served at /ui/assets/live.js (the
// Content-Security-Policy runs scripts from the dashboard's own origin only,
// so the page holds no inline script). Every 2 s it reads /api/queues with
// the session cookie and writes each number into the cell whose id names it:
// `c-total-STATE` and `c-q-QUEUE-STATE`, as the server rendered them.
"use strict";

function setText(id, value) {
  const element = document.getElementById(id);
  if (element) element.textContent = value;
}

async function refresh() {
  try {
    const response = await fetch("/api/queues", { credentials: "same-origin" });
    if (!response.ok) return;
    const overview = await response.json();
    const rows = [["total", overview.total]].concat(
      overview.queues.map((queue) => ["q-" + queue.queue, queue]),
    );
    for (const [name, queue] of rows) {
      for (const state in queue.jobs) setText("c-" + name + "-" + state, queue.jobs[state]);
      setText("c-" + name + "-ready", queue.ready);
      setText("c-" + name + "-ok1m", queue.succeeded_last_minute);
      setText("c-" + name + "-dead1m", queue.dead_last_minute);
    }
    setText("refreshed", new Date().toLocaleTimeString());
  } catch (_) {
    // A missed refresh is retried by the next tick.
  }
}

setInterval(refresh, 2000);
