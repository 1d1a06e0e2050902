// pgq's dashboard: hash-routed views over the JSON of pgq.dashboard, polled
// every two seconds. Every value from the server (queue names, job bodies,
// reasons) goes into the page as text nodes only, never as HTML.
"use strict";
(() => {
  const POLL_MS = 2000;
  const DEAD_PAGE = 100;  // dead letters a page shows
  const TOKEN_KEY = "pgq-dashboard-token";
  const actionsEnabled = document.body.dataset.actions === "true";
  // Beyond loopback every read needs the token too (pgq.dashboard: private).
  const privateReads = document.body.dataset.private === "true";
  const view = document.getElementById("view");
  let shown = "";          // the route and data the view shows: identical polls redraw nothing
  let overview = null;     // the last /api/overview answer
  let busy = false;
  let again = false;
  const finishedJobs = new Map();  // job ID -> its last answer, once it is no longer live

  // ------------------------------------------------------------ helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child !== null && child !== undefined) node.append(child);  // strings become text
    }
    return node;
  }

  function fmt(value) {
    if (value === null || value === undefined || value === "") return "–";
    if (Array.isArray(value)) return value.length ? value.join(", ") : "–";
    if (typeof value === "boolean") return value ? "yes" : "no";
    return String(value);
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 60) return seconds.toFixed(1) + " s";
    if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
    if (seconds < 86400) return (seconds / 3600).toFixed(1) + " h";
    return (seconds / 86400).toFixed(1) + " d";
  }

  function rate(value) {
    return value === null || value === undefined ? "–" : value.toFixed(1) + "/s";
  }

  function when(iso) {
    return iso ? new Date(iso).toLocaleString() : "–";
  }

  function body(item) {
    if (item.body !== undefined) return item.body;
    if (item.body_base64 !== undefined) return "(binary, base64) " + item.body_base64;
    return "";
  }

  function preview(item) {
    return body(item) + (item.truncated ? "…" : "");
  }

  function jobLink(id) {
    return el("a", {href: "#job/" + encodeURIComponent(id), class: "job-link mono"}, id);
  }

  function queueLink(name) {
    return el("a", {href: "#queue/" + encodeURIComponent(name), class: "queue-link"}, name);
  }

  function table(columns, rows, attrs) {
    return el("table", attrs || {},
      el("thead", {}, el("tr", {}, columns.map((c) => el("th", {}, c)))),
      el("tbody", {}, rows));
  }

  function facts(pairs) {
    return el("dl", {class: "facts"},
      pairs.map(([k, v]) => [el("dt", {}, k), el("dd", {"data-field": k}, v)]));
  }

  function flash(message, error) {
    const box = document.getElementById("flash");
    box.textContent = message;
    box.className = error ? "error" : "ok";
    box.hidden = false;
  }

  async function api(path) {
    const headers = {Accept: "application/json"};
    if (token()) headers.Authorization = "Bearer " + token();
    const response = await fetch(path, {headers});
    const data = await response.json().catch(() => ({}));
    if (response.status === 401) {  // a private dashboard, no (or a wrong) token
      sessionStorage.removeItem(TOKEN_KEY);
      showAuth();
    }
    if (!response.ok) {
      const error = new Error(data.message || response.statusText);
      error.status = response.status;
      throw error;
    }
    return data;
  }

  // ------------------------------------------------------------ actions

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function showAuth() {
    const mode = document.getElementById("mode");
    const form = document.getElementById("token-form");
    const lock = document.getElementById("lock");
    const unlocked = Boolean(token());
    if (privateReads && !unlocked) {
      mode.textContent = "locked: enter the token";
      mode.className = "badge warn";
      form.hidden = false;
      lock.hidden = true;
      return;
    }
    if (!actionsEnabled) {
      mode.textContent = "read-only";
      mode.className = "badge";
      form.hidden = lock.hidden = true;
      return;
    }
    mode.textContent = unlocked ? "actions unlocked" : "actions locked";
    mode.className = unlocked ? "badge good" : "badge warn";
    form.hidden = unlocked;
    lock.hidden = !unlocked;
  }

  async function act(path, payload, done) {
    const headers = {"Content-Type": "application/json", Accept: "application/json"};
    if (token()) headers.Authorization = "Bearer " + token();
    try {
      const response = await fetch(path, {method: "POST", headers, body: JSON.stringify(payload)});
      const data = await response.json().catch(() => ({}));
      if (!response.ok) {
        if (response.status === 403 && data.error === "forbidden") {
          sessionStorage.removeItem(TOKEN_KEY);
          showAuth();
          document.getElementById("token").focus();
        }
        flash("Refused: " + (data.message || response.statusText), true);
        return;
      }
      flash(done(data), false);
      finishedJobs.clear();
      refresh(true);
    } catch (error) {
      flash("Failed: " + error.message, true);
    }
  }

  function pauseButtons(name, paused) {
    if (!actionsEnabled) return null;
    const set = (state) => () => act("api/queue/pause?name=" + encodeURIComponent(name), {state},
      (data) => `Queue ${data.queue} is now paused: ${data.paused}`);
    return paused === "none"
      ? el("button", {type: "button", class: "pause", onclick: set("all")}, "Pause")
      : el("button", {type: "button", class: "resume", onclick: set("none")}, "Resume");
  }

  function requeueButton(ids) {
    if (!actionsEnabled) return null;
    return el("button", {type: "button", class: "requeue",
      onclick: () => act("api/dead-letters/requeue", {ids},
        (data) => "Requeued as " + data.requeued.join(", "))}, "Requeue");
  }

  // -------------------------------------------------------------- views

  function queuesView() {
    const queues = overview.queues;
    if (!queues.length) return el("section", {}, el("h2", {}, "Queues"), el("p", {class: "muted"}, "No queues yet."));
    const rows = queues.map((q) => el("tr", {"data-queue": q.name, class: q.paused === "none" ? "" : "is-paused"},
      el("td", {}, queueLink(q.name)),
      el("td", {class: "num length"}, fmt(q.length)),
      el("td", {class: "num"}, fmt(q.active)),
      el("td", {class: "num"}, rate(q.in_rate)),
      el("td", {class: "num"}, rate(q.out_rate)),
      el("td", {class: "num"}, age(q.oldest_age)),
      el("td", {class: "paused"}, q.paused),
      el("td", {class: "num"}, fmt(q.blocked)),
      el("td", {}, pauseButtons(q.name, q.paused))));
    return el("section", {},
      el("h2", {}, "Queues ", el("span", {class: "muted"}, `(${queues.length})`)),
      table(["Queue", "Length", "Active", "In", "Out", "Oldest", "Paused", "Blocked", ""], rows, {id: "queues"}));
  }

  function queueView(name, data) {
    const q = data.queue;
    const jobs = data.jobs.map((j) => el("tr", {"data-job": j.id},
      el("td", {}, jobLink(j.id)), el("td", {}, el("code", {class: "preview"}, preview(j)))));
    return el("section", {"data-queue": name},
      el("h2", {}, "Queue ", el("span", {class: "mono"}, q.name), " ", pauseButtons(q.name, q.pause)),
      facts([["length", fmt(q.len)], ["paused", q.pause], ["oldest job", age(q.age)],
             ["idle", age(q.idle)], ["jobs in", fmt(q.jobs_in)], ["jobs out", fmt(q.jobs_out)],
             ["blocked clients", fmt(q.blocked)]]),
      el("h3", {}, "Next queued jobs"),
      jobs.length ? table(["Job", "Body"], jobs, {id: "queue-jobs"}) : el("p", {class: "muted"}, "None queued."));
  }

  function jobView(id, data) {
    const parts = [el("h2", {}, "Job ", el("span", {class: "mono", id: "job-title"}, id))];
    const job = data.job;
    if (job) {
      parts.push(facts([["state", job.state], ["queue", queueLink(job.queue || "")],
        ["created", when(job.created_at)], ["replication", fmt(job.repl)], ["ttl", age(job.ttl)],
        ["retry", age(job.retry)], ["delay", age(job.delay)], ["nacks", fmt(job.nacks)],
        ["additional deliveries", fmt(job.additional_deliveries)], ["deliveries", fmt(job.deliveries)],
        ["next requeue within", age(job.next_requeue_within)], ["next awake within", age(job.next_awake_within)],
        ["nodes delivered", fmt(job.nodes_delivered)], ["nodes confirmed", fmt(job.nodes_confirmed)]]));
      if (job.body !== null && job.body !== undefined || job.body_base64 !== undefined) {
        parts.push(el("h3", {}, "Body"), el("pre", {class: "body"}, body(job)));
      }
    } else {
      parts.push(el("p", {class: "muted"}, "Not live on this node (acknowledged, dead or expired)."));
    }
    const dead = data.dead_letter;
    if (dead) {
      parts.push(el("h3", {}, "Dead letter ", requeueButton([id])),
        facts([["reason", dead.reason], ["died", when(dead.died_at)], ["deliveries", fmt(dead.deliveries)],
               ["nacks", fmt(dead.nacks)]]),
        el("pre", {class: "body"}, body(dead)));
    }
    parts.push(el("h3", {}, "History"));
    parts.push(data.history.length
      ? table(["Outcome", "Created", "Delivered", "Finished", "Lifetime", "Deliveries", "Nacks"],
          data.history.map((h) => el("tr", {},
            el("td", {class: "outcome"}, h.outcome), el("td", {}, when(h.created_at)),
            el("td", {}, when(h.delivered_at)), el("td", {}, when(h.finished_at)),
            el("td", {class: "num"}, age(h.lifetime)), el("td", {class: "num"}, fmt(h.deliveries)),
            el("td", {class: "num"}, fmt(h.nacks)))), {id: "history"})
      : el("p", {class: "muted"}, "No history on this node yet (a job gets a row when it is done with)."));
    return el("section", {id: "job"}, parts);
  }

  // The page of #dead/SEQ starts after dead letter SEQ ("0": the first page).
  function deadAfter(arg) {
    return /^\d+$/.test(arg) && BigInt(arg) > 0n ? String(BigInt(arg)) : "0";
  }

  function deadView(data, after) {
    const items = data.dead_letters;
    // Pages of DEAD_PAGE, oldest first: the count in the menu may be far
    // more than one page shows.
    const pages = el("p", {class: "pages"},
      after !== "0" ? el("a", {href: "#dead", id: "dead-first"}, "← first page") : null,
      after !== "0" && data.next ? " · " : null,
      data.next ? el("a", {href: "#dead/" + data.next, id: "dead-next"}, "next " + DEAD_PAGE + " →") : null);
    const rows = items.map((d) => el("tr", {"data-dead": d.id},
      el("td", {}, jobLink(d.id)), el("td", {}, queueLink(d.queue)), el("td", {class: "reason"}, d.reason),
      el("td", {class: "num"}, fmt(d.deliveries)), el("td", {}, when(d.died_at)),
      el("td", {}, el("code", {class: "preview"}, preview(d))), el("td", {}, requeueButton([d.id]))));
    return el("section", {},
      el("h2", {}, "Dead letters"),
      items.length
        ? table(["Job", "Queue", "Reason", "Deliveries", "Died", "Body", ""], rows, {id: "dead-letters"})
        : el("p", {class: "muted", id: "no-dead"}, after !== "0" ? "No more dead letters." : "No dead letters."),
      pages);
  }

  function nodesView() {
    const nodes = overview.nodes;
    if (!nodes.length) {
      return el("section", {}, el("h2", {}, "Nodes"),
        el("p", {id: "single-node"}, "Single node: no node process has served this database, so it is not " +
          "part of a cluster (pgq node start makes it one)."));
    }
    const rows = nodes.map((n) => el("tr", {"data-node": n.name, class: "status-" + n.status.replace(/\W+/g, "-")},
      el("td", {}, n.name || "–", n.myself ? el("span", {class: "badge"}, "this node") : null),
      el("td", {class: "mono", title: n.id}, n.id.slice(0, 12)),
      el("td", {class: "mono"}, fmt(n.bus)),
      el("td", {class: "status"}, n.status),
      el("td", {}, n.leaving ? "leaving" : ""),
      el("td", {class: "num"}, age(n.seen_ago))));
    const node = overview.node;
    return el("section", {},
      el("h2", {}, "Nodes ", el("span", {class: "muted"}, `(${nodes.length})`)),
      el("p", {class: "muted"}, `This node ${node.name || node.id.slice(0, 12)}: ` +
        (node.active ? `serving, ${node.reachable} node(s) reachable` : "its node process is not running")),
      table(["Name", "ID", "Bus", "Status", "", "Last update"], rows, {id: "nodes"}));
  }

  // ------------------------------------------------------------ routing

  function route() {
    const hash = location.hash.slice(1) || "queues";
    const slash = hash.indexOf("/");
    const name = slash < 0 ? hash : hash.slice(0, slash);
    let arg = "";
    try {
      arg = slash < 0 ? "" : decodeURIComponent(hash.slice(slash + 1));
    } catch (error) {
      arg = hash.slice(slash + 1);
    }
    return {name, arg};
  }

  async function load(where) {
    switch (where.name) {
      case "queue":
        // ?name=: a path segment "." or ".." is resolved by the browser
        return api("api/queue?name=" + encodeURIComponent(where.arg));
      case "job": {
        if (finishedJobs.has(where.arg)) return finishedJobs.get(where.arg);
        const data = await api("api/jobs/" + encodeURIComponent(where.arg));
        if (!data.job || data.job.state === "acked") finishedJobs.set(where.arg, data);  // nothing will change
        return data;
      }
      case "dead":  // #dead/SEQ: the page after that dead letter
        return api("api/dead-letters?count=" + DEAD_PAGE + "&after=" + deadAfter(where.arg));
      default:
        return null;  // queues and nodes come from the overview
    }
  }

  function render(where, data) {
    switch (where.name) {
      case "queue": return queueView(where.arg, data);
      case "job": return jobView(where.arg, data);
      case "dead": return deadView(data, deadAfter(where.arg));
      case "nodes": return nodesView();
      default: return queuesView();
    }
  }

  function header() {
    const node = overview.node;
    document.getElementById("node-name").textContent =
      (node.name || node.id.slice(0, 12)) + (overview.clustered ? ` · ${overview.nodes.length} nodes` : " · single node");
    document.getElementById("dead-count").textContent =
      overview.dead_letters ? String(overview.dead_letters) + (overview.dead_letters_more ? "+" : "") : "";
    const updated = document.getElementById("updated");
    updated.textContent = "live · updated " + new Date().toLocaleTimeString();
    updated.className = "muted";
    const current = route().name;
    for (const [link, names] of [["nav-queues", ["queues", "queue"]], ["nav-dead", ["dead"]], ["nav-nodes", ["nodes"]]]) {
      document.getElementById(link).classList.toggle("current", names.includes(current));
    }
  }

  async function refresh(force) {
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    const where = route();
    try {
      overview = await api("api/overview");
      header();
      let data = null;
      let failure = null;
      try {
        data = await load(where);
      } catch (error) {
        failure = error;
      }
      const fromOverview = where.name !== "queue" && where.name !== "job" && where.name !== "dead";
      const key = JSON.stringify([where, failure ? failure.message : data,
        fromOverview ? {...overview, time: null} : null]);
      if (force || key !== shown) {
        shown = key;
        view.replaceChildren(failure
          ? el("section", {}, el("p", {class: "error", id: "view-error"}, failure.message))
          : render(where, data));
      }
    } catch (error) {
      const updated = document.getElementById("updated");
      updated.textContent = "connection lost: " + error.message + " (retrying)";
      updated.className = "error-text";
    } finally {
      busy = false;
      if (again) {
        again = false;
        refresh(true);
      }
    }
  }

  async function poll() {
    await refresh(false);
    setTimeout(poll, POLL_MS);
  }

  // ------------------------------------------------------------- wiring

  document.getElementById("open-job").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("job-id");
    const id = input.value.trim();
    input.value = "";
    if (id) location.hash = "#job/" + encodeURIComponent(id);
  });
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("token");
    if (!input.value.trim()) return;
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    showAuth();
    flash(privateReads ? "Unlocked for this browser tab." : "Actions unlocked for this browser tab.",
          false);
    if (privateReads) refresh(true);
  });
  document.getElementById("lock").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showAuth();
  });
  window.addEventListener("hashchange", () => {
    document.getElementById("flash").hidden = true;
    refresh(true);
  });
  showAuth();
  poll();
})();
