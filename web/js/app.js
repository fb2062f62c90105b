// Demo chat page: loads the site's model with mlcc's web engine and streams answers.
import { MLCEngine } from "./engine.js";
import { Template } from "./vendor/jinja.js";

const $ = (id) => document.getElementById(id);
const history = [];
// ?max_tokens=N caps answers typed into the page (tests use it to keep software-GPU runs short)
const MAX_TOKENS = Number(new URLSearchParams(location.search).get("max_tokens") || 256);
window.mlccState = "loading";

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.innerHTML = `<b>${role === "user" ? "You" : "Assistant"}:</b> <span></span>`;
  div.querySelector("span").textContent = text;
  $("log").appendChild(div);
  return div.querySelector("span");
}

async function main() {
  const site = await (await fetch("site.json")).json();
  const t0 = performance.now();
  const engine = await MLCEngine.create({
    models: site.models,
    deps: { tvmjs: window.tvmjs, tokenizers: window.tokenizers, Template, xgrammar: window.xgrammar },
    useCache: true,
    onProgress: (p) => {
      $("status").textContent = `${p.stage}: ${p.text}`;
      if (p.total) $("progress").value = p.loaded / p.total;
    },
  });
  const loadS = ((performance.now() - t0) / 1000).toFixed(1);
  window.mlccEngine = engine;
  window.mlccLoadSeconds = Number(loadS);
  const adapter = engine.adapterInfo.description || engine.adapterInfo.vendor || "WebGPU";
  $("status").textContent = `ready: ${engine.modelId} (${engine.config.quantization}) on ${adapter}, loaded in ${loadS}s`;
  $("progress").value = 1;
  $("prompt").disabled = false;
  $("send").disabled = false;
  window.mlccState = "ready";
}

async function ask(text, opts = {}) {
  const engine = window.mlccEngine;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const span = addMessage("assistant", "");
  const stream = await engine.chat.completions.create({ messages: history, stream: true,
    stream_options: { include_usage: true }, temperature: 0, max_tokens: MAX_TOKENS, ...opts });
  let reply = "";
  for await (const chunk of stream) {
    if (chunk.choices.length && chunk.choices[0].delta.content) {
      reply += chunk.choices[0].delta.content;
      span.textContent = reply;
    }
  }
  history.push({ role: "assistant", content: reply });
  const s = engine.lastStats;
  $("stats").textContent = `${s.completion_tokens} tokens, prefill ${s.prefill_s.toFixed(2)}s, ` +
    `decode ${s.decode_tok_s ? s.decode_tok_s.toFixed(2) : "-"} tok/s`;
  return { content: reply, stats: s };
}
window.mlccAsk = ask;

$("ask").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  $("send").disabled = true;
  try {
    await ask(text);
  } catch (e) {
    addMessage("assistant", `[error] ${e.message}`);
  } finally {
    $("send").disabled = false;
  }
});

main().catch((e) => {
  window.mlccState = "error";
  window.mlccError = e.message;
  $("status").textContent = `error: ${e.message}`;
  console.error(e);
});
