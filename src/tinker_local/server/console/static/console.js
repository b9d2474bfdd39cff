// The live parts of a console page: every element with data-refresh="URL" is fetched again
// every data-every seconds and replaced with the server's HTML (already escaped by the
// server's templates). No page reload; a fetch that lands on the login page reloads the page
// (the login cookie expired), which then shows the login form.
"use strict";

function keepFresh(element) {
  const every = Math.max(1, Number(element.dataset.every || 3)) * 1000;
  const tick = async () => {
    try {
      const answer = await fetch(element.dataset.refresh, {
        credentials: "same-origin",
        headers: { Accept: "text/html" },
        cache: "no-store",
      });
      if (answer.redirected || answer.status === 401) {
        window.location.reload();
        return;
      }
      if (answer.ok) {
        const open = new Set(
          [...element.querySelectorAll("details[open] summary")].map((s) => s.textContent)
        );
        element.innerHTML = await answer.text();
        for (const summary of element.querySelectorAll("details summary")) {
          if (open.has(summary.textContent)) summary.parentElement.open = true;
        }
        element.dataset.refreshed = String(Number(element.dataset.refreshed || 0) + 1);
      }
    } catch (error) {
      // The server restarted or the network dropped: try again at the next tick.
    }
    window.setTimeout(tick, every);
  };
  window.setTimeout(tick, every);
}

document.querySelectorAll("[data-refresh]").forEach(keepFresh);
