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
  });

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
  if (["overview", "leases", "queue"].indexOf(page) < 0 || typeof EventSource === "undefined") return;
  var status = document.getElementById("live-status");
  var setLive = function (state, text) {
    body.setAttribute("data-live", state);
    if (status) status.textContent = "live: " + text;
  };
  var source = new EventSource("/ui/events");
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
})();
