// The LogicPipe dashboard: draws each snapshot of GET /dashboard/events (server-sent events, one a
// second) and runs the chat box over POST /v1/chat/completions (streamed). Plain browser JavaScript,
// nothing fetched from elsewhere. The API key (when the controller has --http-token-file) is asked
// once, kept in localStorage and sent as `Authorization: Bearer KEY`; the events are read with
// fetch() and a stream reader because EventSource cannot send that header.
"use strict";

const KEY_STORE = "logicpipe.apiKey";
const RETRY_MS = 1000;
const PALETTE = ["#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#ec4899", "#84cc16"];

const $ = (sel) => document.querySelector(sel);
let apiKey = localStorage.getItem(KEY_STORE) || "";
let model = "";
const colours = new Map();   // node id -> its colour, stable while the page is open
const chat = [];             // the conversation: {role, content}

// ---- small helpers --------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") el.style.cssText = v;
    else if (k.startsWith("data-")) el.setAttribute(k, v);
    else el[k] = v;
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function colour(node) {
  if (!colours.has(node)) colours.set(node, PALETTE[colours.size % PALETTE.length]);
  return colours.get(node);
}

function bytes(n) {
  if (!n) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
}

// A node's measured speed: FLOP/s of a matmul and memory bandwidth (its profile).
function speed(n) {
  return n.flops ? `${(n.flops / 1e9).toFixed(0)} GFLOP/s · ${(n.mem_bandwidth / 1e9).toFixed(1)} GB/s` : "-";
}

function count(n, thing) { return `${n} ${thing}${n === 1 ? "" : thing.endsWith("h") ? "es" : "s"}`; }
function rate(x) { return x ? x.toFixed(x < 10 ? 1 : 0) : "0"; }
function layers(start, end) { return end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`; }
function headers() { return apiKey ? { Authorization: `Bearer ${apiKey}` } : {}; }

// ---- the API key ----------------------------------------------------------------------------

function askKey(message) {
  const form = $("#key-form");
  form.hidden = false;
  $("#key-message").textContent = message || "";
  $("#key-input").focus();
}

$("#key-button").addEventListener("click", () => { $("#key-form").hidden = !$("#key-form").hidden; });
$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("#key-input").value.trim();
  localStorage.setItem(KEY_STORE, apiKey);
  $("#key-input").value = "";
  $("#key-form").hidden = true;
  $("#key-message").textContent = "";
  restart();
});
$("#key-forget").addEventListener("click", () => {
  apiKey = "";
  localStorage.removeItem(KEY_STORE);
  restart();
});

// ---- the event stream -----------------------------------------------------------------------

let stream = null;  // the AbortController of the open stream

function restart() {
  if (stream) stream.abort();
  connect();
}

async function connect() {
  const ctl = new AbortController();
  stream = ctl;
  try {
    const r = await fetch("/dashboard/events", { headers: headers(), signal: ctl.signal, cache: "no-store" });
    if (r.status === 401) {
      live("needs an API key", "bad");
      $("#state").textContent = "no key";
      askKey(apiKey ? "The key was refused: give a valid one." : "");
      return;  // until a key is given
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    live("live", "good");
    const reader = r.body.getReader();
    const text = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += text.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (data) draw(JSON.parse(data));
      }
    }
  } catch (err) {
    if (ctl.signal.aborted) return;  // restarted on purpose
  }
  if (stream === ctl) {
    live("reconnecting…", "bad");
    setTimeout(() => { if (stream === ctl) connect(); }, RETRY_MS);
  }
}

function live(text, kind) {
  const el = $("#live");
  el.textContent = text;
  el.className = kind;
}

// ---- drawing a snapshot ---------------------------------------------------------------------

function draw(s) {
  model = s.model;
  $("#model").textContent = `${s.model} · ${s.layers} layers`;
  const state = $("#state");
  state.textContent = s.state;
  state.className = `badge ${s.state}`;
  state.title = s.reason || "";
  $("#generation").textContent = s.generation ? `plan generation ${s.generation} · ${count(s.replans, "plan")} so far` : "";
  drawSummary(s);
  drawPlan(s);
  drawNodes(s);
  drawRequests(s);
  drawHistory(s);
}

function card(label, value, id) {
  return h("div", { class: "card", "data-card": id },
    h("div", { class: "value" }, value), h("div", { class: "label" }, label));
}

function drawSummary(s) {
  const r = s.requests;
  const kvUsed = s.pipelines.flatMap((p) => p.stages).reduce((a, x) => a + x.kv_blocks_used, 0);
  const kvTotal = s.pipelines.flatMap((p) => p.stages).reduce((a, x) => a + x.kv_blocks_total, 0);
  $("#summary").replaceChildren(
    card("tokens/s out", rate(r.tokens_per_s), "tokens_per_s"),
    card("running", r.running, "running"),
    card("queued", r.queued, "queued"),
    card("KV blocks in use", kvTotal ? `${kvUsed} / ${kvTotal}` : "-", "kv"),
    card("completed", r.completed, "completed"),
    card("failed / cancelled", `${r.failed} / ${r.cancelled}`, "failed"),
    card("replayed", r.replays, "replays"),
  );
}

// A track of `total` layers with one bar per stage [start, end), coloured by node.
function track(total, spans, tall) {
  const el = h("div", { class: tall ? "track tall" : "track", style: `--layers: ${total}` });
  for (const sp of spans) {
    const left = (100 * sp.start) / total;
    const width = (100 * (sp.end - sp.start)) / total;
    el.append(h("div", {
      class: "bar", title: `${sp.node}: ${layers(sp.start, sp.end)}`,
      style: `left: ${left}%; width: ${width}%; background: ${colour(sp.node)}`,
    }, tall ? `${sp.start}–${sp.end - 1}` : ""));
  }
  return el;
}

function drawPlan(s) {
  const box = $("#plan");
  $("#plan-note").textContent = s.pipelines.length > 1 ? `${s.pipelines.length} pipelines (replicas)` : "";
  if (!s.pipelines.length) {
    box.replaceChildren(h("p", { class: "muted" }, s.reason || "no plan yet"));
    return;
  }
  box.replaceChildren(...s.pipelines.map((p) => h("div", { class: "pipeline", "data-pipeline": p.index },
    h("div", { class: "pipeline-head" },
      h("strong", {}, `pipeline ${p.index}`),
      h("span", { class: p.serving ? "good" : "bad" }, p.serving ? "serving" : "not serving"),
      h("span", { class: "muted" },
        `${count(p.stages.length, "stage")} · ${p.running} running · ${count(p.micro_batches, "micro-batch")}` +
        (p.predicted_tokens_per_s ? ` · ${rate(p.predicted_tokens_per_s)} tokens/s predicted` : ""))),
    h("div", { class: "stage-row legend" }, h("span", {}, "node"), h("span", {}, `layers 0–${s.layers - 1}`),
      h("span", {}, "layers"), h("span", {}, "tokens/s"), h("span", {}, "busy"), h("span", {}, "KV blocks")),
    ...p.stages.map((st) => h("div", {
      class: st.down ? "stage-row down" : "stage-row", title: st.down || "",
      "data-node": st.node_id, "data-start": st.start, "data-end": st.end,
    },
      h("span", { class: "node" }, h("i", { class: "dot", style: `background: ${colour(st.node_id)}` }), st.node_id),
      track(s.layers, [{ node: st.node_id, start: st.start, end: st.end }], true),
      h("span", {}, layers(st.start, st.end)),
      h("span", { class: "num", "data-field": "tokens_per_s" }, rate(st.tokens_per_s)),
      h("span", { class: "num", "data-field": "busy" }, `${Math.round(100 * st.busy)}%`),
      kv(st)),
    ))));
}

function kv(st) {
  const share = st.kv_blocks_total ? st.kv_blocks_used / st.kv_blocks_total : 0;
  return h("span", { class: "kv", title: `${st.kv_blocks_cached} more kept for the prefix cache` },
    h("span", { class: "meter" }, h("span", { style: `width: ${Math.max(share * 100, share ? 2 : 0)}%` })),
    `${st.kv_blocks_used}/${st.kv_blocks_total}`);
}

function drawNodes(s) {
  $("#nodes tbody").replaceChildren(...s.nodes.map((n) => h("tr", { "data-node": n.node_id, "data-state": n.state },
    h("td", {}, h("i", { class: "dot", style: `background: ${n.state === "in plan" ? colour(n.node_id) : "#9ca3af"}` }),
      n.node_id || "?"),
    h("td", { class: "mono" }, n.address),
    h("td", { title: n.device_name }, n.device ? `${n.device}${n.device_name ? ` · ${n.device_name}` : ""}` : "-"),
    h("td", { class: "num" }, bytes(n.memory_bytes)),
    h("td", { class: "num" }, speed(n)),
    h("td", {}, h("span", { class: `badge ${n.state.replace(" ", "-")}` },
      n.state + (n.pipeline !== null && s.pipelines.length > 1 ? ` ${n.pipeline}` : ""))),
    h("td", { class: "why" }, n.why_out))));
}

function drawRequests(s) {
  const rows = [
    ...s.active.map((r) => h("tr", { class: "active", "data-request": r.id },
      h("td", { class: "mono", title: r.id }, r.id.slice(0, 10)), h("td", {}, r.api), h("td", {}, r.state),
      h("td", {}, r.pipeline ?? "-"), h("td", { class: "num" }, `${r.tokens} / ${r.max_tokens}`),
      h("td", { class: "num" }, rate(r.tokens_per_s)), h("td", { class: "num" }, `${r.age_s.toFixed(1)} s`))),
    ...s.recent.map((r) => h("tr", { class: "done", "data-request": r.id },
      h("td", { class: "mono", title: r.id }, r.id.slice(0, 10)), h("td", {}, r.api),
      h("td", {}, `${r.outcome}${r.finish_reason ? ` (${r.finish_reason})` : ""}`), h("td", {}, "-"),
      h("td", { class: "num" }, r.tokens), h("td", { class: "num" }, rate(r.tokens_per_s)),
      h("td", { class: "num" }, `${r.total_s.toFixed(1)} s`))),
  ];
  const listed = s.active.length;
  const more = s.requests.open - listed;
  if (more > 0) rows.splice(listed, 0, h("tr", {}, h("td", { colSpan: 7, class: "muted" }, `and ${more} more`)));
  const none = h("tr", {}, h("td", { colSpan: 7, class: "muted" }, "no requests yet"));
  $("#requests tbody").replaceChildren(...(rows.length ? rows : [none]));
}

function drawHistory(s) {
  $("#history").replaceChildren(...s.history.map((e) => h("li", { "data-generation": e.generation },
    h("div", { class: "when" }, new Date(e.at * 1000).toLocaleTimeString(), h("span", { class: "muted" },
      ` · serving ${e.took_s.toFixed(1)} s after · ${count(e.replayed, "request")} moved`)),
    h("div", { class: "why" }, e.why),
    ...e.pipelines.map((p) => h("div", { class: "mini" }, track(s.layers, p, false),
      h("span", { class: "muted" }, p.map((x) => x.node).join(" → ")))))));
}

// ---- the chat box ---------------------------------------------------------------------------

function say(role, text) {
  const el = h("div", { class: `msg ${role}` }, h("div", { class: "who" }, role), h("div", { class: "text" }, text));
  $("#chat-log").append(el);
  $("#chat-log").scrollTop = $("#chat-log").scrollHeight;
  return el;
}

async function send(ev) {
  ev.preventDefault();
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  chat.push({ role: "user", content: text });
  say("user", text);
  const out = say("assistant", "");
  const body = out.querySelector(".text");
  $("#chat-send").disabled = true;
  let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...headers() },
      body: JSON.stringify({
        model, messages: chat, stream: true,
        max_tokens: Number($("#max-tokens").value) || 128, temperature: Number($("#temperature").value) || 0,
      }),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error?.message || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      const lines = buf.split("\n");
      buf = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        answer += chunk.choices?.[0]?.delta?.content || "";
        body.textContent = answer;
      }
    }
    chat.push({ role: "assistant", content: answer });
    out.setAttribute("data-done", "1");
  } catch (err) {
    chat.pop();
    out.classList.add("error");
    body.textContent = answer + (answer ? "\n" : "") + `error: ${err.message}`;
    out.setAttribute("data-done", "error");
  } finally {
    $("#chat-send").disabled = false;
  }
}

$("#chat-form").addEventListener("submit", send);
$("#chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) send(ev);
});
$("#chat-clear").addEventListener("click", () => {
  chat.length = 0;
  $("#chat-log").replaceChildren();
});

connect();
