// gpupool web dashboard: confirmation of admin forms and live updates from /ui/events.
// Our own code, no library. Everything shown is set with textContent (never innerHTML).
"use strict";

(function () {
  var ICONS = { free: "○", leased: "●", scrubbing: "◐", quarantined: "✖", drained: "■" };
  var STATES = ["free", "leased", "scrubbing", "quarantined", "drained"];
  var body = document.body;

  // ---------------------------------------------------------------- formatting (as the server)
  function bytes(n) {
    if (typeof n !== "number") return "n/a";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var v = n;
    for (var i = 0; i < units.length; i++) {
      if (Math.abs(v) < 1024 || i === units.length - 1) {
        return i === 0 ? v.toFixed(0) + " B" : v.toFixed(1) + " " + units[i];
      }
      v /= 1024;
    }
    return String(n);
  }
  function pad(x) { return (x < 10 ? "0" : "") + x; }
  function when(t) {
    if (typeof t !== "number") return "n/a";
    var d = new Date(t * 1000);
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }
  function duration(s) {
    if (typeof s !== "number") return "n/a";
    s = Math.floor(s);
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    if (h) return h + "h " + pad(m) + "m " + pad(sec) + "s";
    if (m) return m + "m " + pad(sec) + "s";
    return sec + "s";
  }

  // ---------------------------------------------------------------- small DOM helpers
  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) {
        if (k === "text") e.textContent = attrs[k];
        else if (k === "class") e.className = attrs[k];
        else e.setAttribute(k, attrs[k]);
      });
    }
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return e;
  }
  function adminForm(action, url, label, question, next) {
    return el("form", { method: "post", action: url, class: "inline admin-form", "data-confirm": question }, [
      el("input", { type: "hidden", name: "csrf", value: body.dataset.csrf || "" }),
      el("input", { type: "hidden", name: "next", value: next || "/ui/" }),
      el("input", { type: "hidden", name: "confirm", value: "" }),
      el("button", { type: "submit", "data-action": action, text: label })
    ]);
  }
  function progress(max, value) {
    return el("progress", { class: "bar", max: String(max), value: String(value) });
  }

  // ---------------------------------------------------------------- a GPU card
  function cardChildren(g, idleMinutes) {
    var live = g.live || {};
    var lease = g.lease;
    var out = [];
    var h = el("h2", null, [el("span", { class: "gpu-index", text: "GPU " + g.index }), " ",
      el("span", { class: "model", text: g.name })]);
    if (g.simulated) { h.appendChild(document.createTextNode(" ")); h.appendChild(el("span", { class: "tag", text: "simulated" })); }
    out.push(h);
    var st = el("p", { class: "state" }, [el("span", { class: "icon", "aria-hidden": "true", text: ICONS[g.state] || "?" }), " ",
      el("strong", { class: "state-word", text: g.state })]);
    if (g.draining && g.state !== "drained") { st.appendChild(document.createTextNode(" ")); st.appendChild(el("strong", { class: "draining", text: "draining" })); }
    st.appendChild(document.createTextNode(" "));
    st.appendChild(el("span", { class: "since", text: "since " + when(g.since) }));
    out.push(st);
    if (g.idle) {
      out.push(el("p", { class: "idle-note" }, [el("strong", { text: "idle while leased" }),
        " (0 % utilisation for " + idleMinutes + " min or more)"]));
    }
    var total = live.memory_total || g.memory_total;
    var used = live.memory_used;
    var mem = el("div", { class: "metric" }, [el("span", { class: "label", text: "Memory" })]);
    if (typeof used === "number" && total) {
      mem.appendChild(progress(total, used));
      mem.appendChild(el("span", { class: "value", text: bytes(used) + " / " + bytes(total) + " (" + Math.round(100 * used / total) + " %)" }));
    } else {
      mem.appendChild(progress(1, 0));
      mem.appendChild(el("span", { class: "value", text: bytes(total) + " total, used: not reported" }));
    }
    out.push(mem);
    var util = el("div", { class: "metric" }, [el("span", { class: "label", text: "Utilisation" })]);
    if (typeof live.gpu_util === "number") {
      util.appendChild(progress(100, live.gpu_util));
      util.appendChild(el("span", { class: "value", text: live.gpu_util + " %" }));
    } else {
      util.appendChild(progress(100, 0));
      util.appendChild(el("span", { class: "value", text: "not reported" }));
    }
    out.push(util);
    var facts = el("dl", { class: "facts" });
    facts.appendChild(el("dt", { text: "Temperature" }));
    facts.appendChild(el("dd", { text: typeof live.temperature_c === "number" ? live.temperature_c + " °C" : "not reported" }));
    var power = "not reported";
    if (typeof live.power_w === "number") {
      power = live.power_w.toFixed(1) + " W";
      if (typeof live.power_limit_w === "number") power += " of " + Math.round(live.power_limit_w) + " W";
    }
    facts.appendChild(el("dt", { text: "Power" }));
    facts.appendChild(el("dd", { text: power }));
    if (lease) {
      var c = lease.client || {};
      facts.appendChild(el("dt", { text: "Holder" }));
      facts.appendChild(el("dd", { class: "holder" }, [el("span", { class: "token", text: lease.token }), " on ",
        el("span", { class: "host", text: String(c.host) }), ", pid ", el("span", { class: "pid", text: String(c.pid) }),
        ", since " + when(lease.started) + " (lease " + lease.id + ")"]));
    }
    if (g.shares) {  // a shared GPU (issue 32): each share's holder, use and quota
      var sh = g.shares;
      var dd = el("dd", { class: "shares", text: sh.leases.length + " of " + sh.max +
        (sh.closed ? ", closed to new shares until its whole scrub" : "") +
        (sh.kept_for_ticket !== null && sh.kept_for_ticket !== undefined ? ", kept for a whole-GPU request" : "") });
      sh.leases.forEach(function (s) {
        var sc = s.client || {};
        dd.appendChild(el("br"));
        dd.appendChild(el("span", { class: "token", text: s.token }));
        dd.appendChild(document.createTextNode(" on "));
        dd.appendChild(el("span", { class: "host", text: String(sc.host) }));
        dd.appendChild(document.createTextNode(", pid "));
        dd.appendChild(el("span", { class: "pid", text: String(sc.pid) }));
        dd.appendChild(document.createTextNode(": " + (typeof s.memory_used === "number" ? bytes(s.memory_used) : "?") +
          " of " + bytes(s.memory_quota) + " (lease " + s.id + ")"));
      });
      facts.appendChild(el("dt", { text: "Shares" }));
      facts.appendChild(dd);
    }
    if (g.stuck) {
      facts.appendChild(el("dt", { text: "Stuck" }));
      facts.appendChild(el("dd", { text: String(g.stuck.why) + " (the watchdog repairs it)" }));
    }
    if (g.quarantine) {
      facts.appendChild(el("dt", { text: "Quarantine" }));
      facts.appendChild(el("dd", { text: String(g.quarantine.reason || JSON.stringify(g.quarantine)) }));
    }
    out.push(facts);
    if (body.dataset.admin === "1") {
      var acts = el("div", { class: "actions" });
      if (g.draining) acts.appendChild(adminForm("undrain", "/ui/gpus/" + g.index + "/undrain", "Undrain", "Put GPU " + g.index + " back in service?"));
      else acts.appendChild(adminForm("drain", "/ui/gpus/" + g.index + "/drain", "Drain", "Drain GPU " + g.index + "? No new lease will be given on it."));
      if (g.state === "quarantined") acts.appendChild(adminForm("clear", "/ui/gpus/" + g.index + "/clear", "Clear quarantine", "Clear the quarantine of GPU " + g.index + "? It will be scrubbed and checked again."));
      if (lease) acts.appendChild(adminForm("end", "/ui/leases/" + lease.id + "/end", "End lease", "End lease " + lease.id + " of " + lease.token + "? The client loses its GPU."));
      out.push(acts);
    }
    return out;
  }

  function renderCards(state) {
    var box = document.getElementById("gpu-cards");
    if (!box) return;
    var idleMinutes = box.dataset.idleMinutes || "5";
    state.gpus.forEach(function (g) {
      var card = box.querySelector('article.gpu-card[data-gpu="' + g.index + '"]');
      if (!card) { card = el("article"); box.appendChild(card); }
      card.className = "gpu-card state-" + g.state + (g.idle ? " idle" : "");
      card.setAttribute("data-gpu", String(g.index));
      card.setAttribute("data-state", g.state);
      card.setAttribute("data-idle", g.idle ? "1" : "0");
      card.setAttribute("data-draining", g.draining ? "1" : "0");
      var kids = cardChildren(g, idleMinutes);
      card.replaceChildren.apply(card, kids);
    });
    var s = state.summary;
    var set = function (id, v) { var e = document.getElementById(id); if (e) e.textContent = String(v); };
    set("sum-gpus", s.gpus); set("sum-leases", s.leases); set("sum-queue", s.queue);
    // the nouns after the counts, as the page's template writes them
    set("sum-gpus-noun", s.gpus === 1 ? "GPU" : "GPUs");
    set("sum-leases-noun", s.leases === 1 ? "active lease" : "active leases");
    STATES.forEach(function (st) {
      var e = document.querySelector('[data-count="' + st + '"]');
      if (e) e.textContent = s.states[st] + " " + st;
    });
  }

  function renderRows(id, rows, empty, cols) {
    var table = document.getElementById(id);
    if (!table) return;
    var tbody = table.tBodies[0];
    var out = rows.map(function (r) {
      var tr = el("tr", r.attrs);
      r.cells.forEach(function (c) { tr.appendChild(typeof c === "string" ? el("td", { text: c }) : el("td", null, [c])); });
      return tr;
    });
    if (!out.length) out = [el("tr", { class: "empty" }, [el("td", { colspan: String(cols), text: empty })])];
    tbody.replaceChildren.apply(tbody, out);
  }

  function renderLeases(state) {
    var admin = body.dataset.admin === "1";
    renderRows("active-leases", state.leases.map(function (l) {
      var c = l.client || {};
      var cells = [String(l.id), l.gpu === null ? "none" : String(l.gpu), l.token, c.host + " pid " + c.pid + " " + (c.program || ""),
        when(l.started), duration(l.duration_s),
        typeof l.memory_used === "number" ? bytes(l.memory_used) : "not reported",
        bytes(l.bytes_h2d + l.bytes_d2h) + " (to GPU " + bytes(l.bytes_h2d) + ", from GPU " + bytes(l.bytes_d2h) + ")",
        l.queued_s + " s", detachText(l.detach)];
      if (admin) cells.push(adminForm("end", "/ui/leases/" + l.id + "/end", "End lease", "End lease " + l.id + " of " + l.token + "? The client loses its GPU.", "/ui/leases"));
      return { attrs: { "data-lease": String(l.id) }, cells: cells };
    }), "No active lease.", 11);
  }

  // A lease's idle-detach state in words (the same words as the template's detach_text filter,
  // gpupoold/dashboard/formatting.py).
  function detachText(d) {
    if (!d) return "";
    var text = d.state;
    if (d.state === "detached" || d.state === "attaching")
      text += " (left GPU " + d.left_gpu + ", " + bytes(d.saved_bytes) + " saved, " + duration(d.detached_s) + " detached in all)";
    else if (d.detaches) text += " (" + d.detaches + "x detached, " + duration(d.detached_s) + " in all)";
    if (d.keep_gpu) text += "; keeps its GPU: " + d.keep_gpu;
    return text;
  }

  function renderQueue(state) {
    renderRows("queue", state.queue.map(function (w) {
      var c = w.client || {};
      return { attrs: { "data-ticket": String(w.ticket) }, cells: [String(w.position), w.token,
        c.host + " pid " + c.pid + " " + (c.program || ""), w.request, when(w.since), duration(w.waiting_s)] };
    }), "Nobody is waiting.", 6);
  }

  // ---------------------------------------------------------------- the Fleet page
  // The same markup as templates/fleet.html, rebuilt from an `event: fleet` (/ui/fleet/events).
  function healthLine(s) {
    var reach;
    if (s.this) reach = "this server";
    else if (s.reachable === true) reach = "reachable from here";
    else if (s.reachable === null || s.reachable === undefined) reach = "reachability not tried yet";
    else reach = el("strong", { text: "not reachable from here" });
    var p = el("p", { class: "health", "data-reachable": s.reachable === true ? "1" : s.reachable === false ? "0" : "" }, [
      "last heartbeat " + (typeof s.heartbeat_age_s === "number" ? duration(s.heartbeat_age_s) + " ago" : "never") +
      " · sync lag " + (typeof s.sync_lag_s === "number" ? duration(s.sync_lag_s) : "n/a") + " · ", reach]);
    if (s.reachable === false && !s.this) p.appendChild(document.createTextNode(" (" + s.reach_error + ")"));
    return p;
  }
  function fleetGpuActions(s, g) {
    var q = "GPU " + g.index + " of server " + s.name;
    var base = "/ui/servers/" + encodeURIComponent(s.name) + "/gpus/" + g.index + "/";
    var acts = el("div", { class: "actions" });
    if (g.state === "drained" || g.state === "draining") acts.appendChild(adminForm("undrain", base + "undrain", "Undrain", "Put " + q + " back in service?", "/ui/fleet"));
    else acts.appendChild(adminForm("drain", base + "drain", "Drain", "Drain " + q + "? No new lease will be given on it.", "/ui/fleet"));
    if (g.state === "quarantined") acts.appendChild(adminForm("clear", base + "clear", "Clear quarantine", "Clear the quarantine of " + q + "? It will be scrubbed and checked again.", "/ui/fleet"));
    if (g.lease_id) acts.appendChild(fleetEnd(s.name, g.lease_id));
    return acts;
  }
  function fleetEnd(server, id) {
    return adminForm("end", "/ui/servers/" + encodeURIComponent(server) + "/leases/" + id + "/end", "End lease",
      "End lease " + id + " on server " + server + "? The client loses its GPU.", "/ui/fleet");
  }
  function fleetServer(s, admin) {
    var h = el("h2", null, [s.name]);
    if (s.this) { h.appendChild(document.createTextNode(" ")); h.appendChild(el("span", { class: "model", text: "(this server)" })); }
    h.appendChild(document.createTextNode(" "));
    h.appendChild(el("span", { class: "badge state-" + s.state, text: s.state }));
    var where = String(s.remoting || "");
    if (s.state === "down") where += ", down since " + when(s.down_since) + ": " + s.down_reason;
    var cards = el("div", { class: "cards" });
    (s.gpus || []).forEach(function (g) {
      var kids = [el("h2", null, ["GPU " + g.index + " ", el("span", { class: "model", text: g.name })]),
        el("p", null, [el("span", { class: "state", text: g.state }), g.available ? null : " (unavailable)"])];
      if (g.lease_id) kids.push(el("p", { text: "lease " + g.lease_id + ", token " + g.token }));
      else if (g.held) kids.push(el("p", { text: "held for a client of token " + g.token + ", on its way" }));
      if (admin && s.state === "up") kids.push(fleetGpuActions(s, g));
      cards.appendChild(el("article", { class: "gpu-card fleet-gpu state-" + g.state, "data-server": s.name,
        "data-gpu": String(g.index), "data-state": g.state, "data-available": g.available ? "1" : "0" }, kids));
    });
    if (!(s.gpus || []).length) cards.appendChild(el("p", { text: "No GPUs reported yet." }));
    return el("section", { class: "fleet-server", "data-server": s.name, "data-state": s.state, "aria-label": "server " + s.name },
      [h, el("p", { class: "model", text: where }), healthLine(s), cards]);
  }
  function fleetProblem(text) {
    var box = document.getElementById("fleet-problem");
    if (!box) return;
    box.replaceChildren.apply(box, text ? [el("p", { class: "note warning", role: "alert", text: text })] : []);
  }
  // What moves by itself (the ages): a view that differs only there rewrites the health lines
  // and leaves the rest, its buttons included, as it is (a click in progress is not lost).
  var FLEET_MOVING = ["heartbeat_age_s", "sync_lag_s", "time", "synced", "syncs"];
  var lastFleet = "";
  function renderFleet(view) {
    var admin = body.dataset.admin === "1";
    var key = JSON.stringify(view, function (k, v) { return FLEET_MOVING.indexOf(k) >= 0 ? undefined : v; });
    var box = document.getElementById("fleet-servers");
    if (key === lastFleet && box) {
      view.servers.forEach(function (s) {
        box.querySelectorAll("section.fleet-server").forEach(function (sec) {
          var line = sec.querySelector("p.health");
          if (sec.dataset.server === s.name && line) line.replaceWith(healthLine(s));
        });
      });
      return;
    }
    lastFleet = key;
    if (box) box.replaceChildren.apply(box, view.servers.map(function (s) { return fleetServer(s, admin); }));
    fleetProblem(view.store_error ? "This server cannot reach the fleet's database (" + view.store_error + "): the view below is as it was " +
      when(view.synced) + ". Running leases go on; new clients are told to try again." : "");
    renderRows("fleet-leases", view.leases.map(function (l) {
      var cells = [String(l.id), String(l.server), String(l.gpu_index), String(l.token_name),
        l.client_user + "@" + l.client_host + " pid " + l.client_pid + " " + (l.program || ""), when(l.started)];
      if (admin) cells.push(fleetEnd(l.server, l.id));
      return { attrs: { "data-lease": String(l.id), "data-server": String(l.server) }, cells: cells };
    }), "No lease is running.", admin ? 7 : 6);
    renderRows("fleet-queue", view.queue.map(function (w) {
      var c = w.client || {};
      return { attrs: { "data-ticket": String(w.ticket) }, cells: [String(w.position), String(w.server), w.token,
        c.host + " pid " + c.pid + " " + (c.program || ""), w.request, when(w.since)] };
    }), "Nobody is waiting.", 6);
  }

  // ---------------------------------------------------------------- confirmation of admin forms
  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (!(form instanceof HTMLFormElement) || !form.classList.contains("admin-form")) return;
    var confirmField = form.querySelector('input[name="confirm"]');
    if (!window.confirm(form.getAttribute("data-confirm") || "Are you sure?")) {
      ev.preventDefault();
      return;
    }
    if (confirmField) confirmField.value = "yes";
    if (body.dataset.page === "fleet") { ev.preventDefault(); sendInPlace(form); }
  });

  // The Fleet page sends its actions without leaving the page (the same form, CSRF field and
  // confirmation): its live view shows what they did, and a refusal is said above the servers.
  function sendInPlace(form) {
    var question = (form.getAttribute("data-confirm") || "the action").split("?")[0];
    fleetAction("sending: " + question, false);
    fetch(form.action, { method: "POST", body: new URLSearchParams(new FormData(form)), redirect: "manual",
      credentials: "same-origin" }).then(function (res) {
      if (res.type === "opaqueredirect" || res.ok) { fleetAction("done: " + question, false); return null; }
      return res.text().then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");  // read, never inserted
        var what = doc.querySelector("p.error");
        var next = what && what.nextElementSibling;
        var hint = next && /^What to do/.test(next.textContent) ? " " + next.textContent : "";
        fleetAction("refused (HTTP " + res.status + "): " + (what ? what.textContent : question) + "." + hint, true);
      });
    }).catch(function (e) {
      fleetAction("not sent: " + e + " (check the connection to this server and try again)", true);
    });
  }
  function fleetAction(text, failed) {
    var line = document.getElementById("fleet-action");
    if (!line) return;
    line.textContent = text;
    line.className = failed ? "error" : "note";
    line.setAttribute("data-result", failed ? "refused" : text.indexOf("done") === 0 ? "done" : "sending");
  }

  // Redraw the last-hour charts from an event's `charts` (polylines computed by the server).
  function renderCharts(charts) {
    if (!charts) return;
    var setText = function (key, text) {
      var el = document.querySelector('[data-now="' + key + '"]');
      if (el && typeof text === "string") el.textContent = text;
    };
    var setLine = function (series, points) {
      var line = document.querySelector('svg.chart[data-series="' + series + '"] polyline');
      if (line && typeof points === "string") line.setAttribute("points", points);
    };
    Object.keys(charts.util || {}).forEach(function (i) {
      setLine("util-" + i, charts.util[i]);
      setText("util-" + i, (charts.util_now || {})[i]);
    });
    setLine("copy", charts.copy);
    setText("copy", charts.copy_now);
    setText("copy-top", charts.copy_top);
    // The axes' labels that move: the time the charts start at, the copy chart's top.
    var setAll = function (axis, text) {
      if (typeof text !== "string") return;
      document.querySelectorAll('[data-axis="' + axis + '"]').forEach(function (el) {
        el.textContent = text;
      });
    };
    setAll("start", charts.span);
    setAll("copy-top", charts.copy_top);
  }

  // ---------------------------------------------------------------- live updates
  var page = body.dataset.page;
  if (["overview", "leases", "queue", "fleet"].indexOf(page) < 0 || typeof EventSource === "undefined") return;
  var status = document.getElementById("live-status");
  var setLive = function (state, text) {
    body.setAttribute("data-live", state);
    if (status) status.textContent = "live: " + text;
  };
  var source = new EventSource(page === "fleet" ? "/ui/fleet/events" : "/ui/events");
  source.onopen = function () { setLive("connected", "connected"); };
  source.onerror = function () {
    setLive(source.readyState === EventSource.CLOSED ? "closed" : "reconnecting",
      source.readyState === EventSource.CLOSED ? "disconnected (reload the page)" : "reconnecting");
  };
  source.addEventListener("state", function (ev) {
    var state;
    try { state = JSON.parse(ev.data); } catch (e) { return; }
    setLive("connected", "connected, updated " + when(state.time).slice(11));
    if (page === "overview") { renderCards(state); renderCharts(state.charts); }
    else if (page === "leases") renderLeases(state);
    else if (page === "queue") renderQueue(state);
  });
  source.addEventListener("fleet", function (ev) {
    var view;
    try { view = JSON.parse(ev.data); } catch (e) { return; }
    setLive("connected", "connected, updated " + when(view.time).slice(11));
    renderFleet(view);
  });
  source.addEventListener("problem", function (ev) {
    var p;
    try { p = JSON.parse(ev.data); } catch (e) { return; }
    setLive("connected", "connected, the fleet's database cannot be read");
    fleetProblem(String(p.error));
  });
})();
