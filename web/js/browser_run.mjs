// Drive the demo page in headless Chromium (playwright-core, the system chromium): load, ask, report JSON.
//   node browser_run.mjs SITE_URL --prompt TEXT [--max-tokens N] [--screenshot FILE] [--timeout S]
//                        [--request JSON]   (then also one engine.chat.completions.create(JSON) in the page)
import { createRequire } from "node:module";
const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core");

const argv = process.argv.slice(2);
const opt = { url: null, prompt: "Hello!", maxTokens: 16, screenshot: null, timeout: 600, typed: false,
  reload: false, request: null };
for (let i = 0; i < argv.length; i++) {
  const a = argv[i];
  if (a === "--prompt") opt.prompt = argv[++i];
  else if (a === "--max-tokens") opt.maxTokens = Number(argv[++i]);
  else if (a === "--screenshot") opt.screenshot = argv[++i];
  else if (a === "--timeout") opt.timeout = Number(argv[++i]);
  else if (a === "--typed") opt.typed = true;
  else if (a === "--reload") opt.reload = true;
  else if (a === "--request") opt.request = JSON.parse(argv[++i]);
  else opt.url = a;
}
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";
const userDir = require("node:fs").mkdtempSync(require("node:path").join(require("node:os").tmpdir(), "mlcc-chrome-"));
const browser = await chromium.launchPersistentContext(userDir, {
  executablePath, headless: true,
  args: ["--enable-unsafe-webgpu", "--no-sandbox", "--disable-gpu-sandbox", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic"],
});
const page = browser.pages()[0] || (await browser.newPage());
const consoleLines = [];
page.on("console", (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
page.on("pageerror", (e) => consoleLines.push(`pageerror: ${e.message}`));
let out = { ok: false };
try {
  const t0 = Date.now();
  await page.goto(opt.typed ? `${opt.url}?max_tokens=${opt.maxTokens}` : opt.url);
  await page.waitForFunction(() => window.mlccState && window.mlccState !== "loading", null,
    { timeout: opt.timeout * 1000 });
  const state = await page.evaluate(() => ({ state: window.mlccState, error: window.mlccError || null,
    load_s: window.mlccLoadSeconds || null, status: document.getElementById("status").textContent }));
  if (state.state !== "ready") throw new Error(`page did not load: ${state.error}`);
  let result;
  if (opt.typed) {
    // through the UI, like a user: type, press Send, wait for the answer to finish
    await page.fill("#prompt", opt.prompt);
    await page.click("#send");
    await page.waitForFunction(() => document.getElementById("stats").textContent.length > 0, null,
      { timeout: opt.timeout * 1000 });
    result = await page.evaluate(() => ({ content: document.querySelectorAll(".assistant span")[0].textContent,
      stats: window.mlccEngine.lastStats }));
  } else {
    result = await page.evaluate(([p, n]) => window.mlccAsk(p, { max_tokens: n }), [opt.prompt, opt.maxTokens]);
  }
  let request = null;
  if (opt.request) {
    request = await page.evaluate(async (req) => {
      try {
        return { reply: await window.mlccEngine.chat.completions.create(req), xgrammar: !!window.xgrammar };
      } catch (e) {
        return { error: { name: e.name, message: e.message, param: e.param ?? null } , xgrammar: !!window.xgrammar };
      }
    }, opt.request);
  }
  if (opt.screenshot) await page.screenshot({ path: opt.screenshot, fullPage: true });
  let reload = null;
  if (opt.reload) {
    // a second visit: the weights should come from the Cache API, not the network
    await page.reload();
    await page.waitForFunction(() => window.mlccState && window.mlccState !== "loading", null,
      { timeout: opt.timeout * 1000 });
    reload = await page.evaluate(() => ({ state: window.mlccState,
      shards_from_cache: window.mlccEngine ? window.mlccEngine.shardsFromCache : null }));
  }
  out = { ok: true, ...state, content: result.content, token_ids: result.stats.token_ids,
    decode_tok_s: result.stats.decode_tok_s, prefill_s: result.stats.prefill_s, total_s: (Date.now() - t0) / 1000,
    reload, request };
} catch (e) {
  out = { ok: false, error: e.message, console: consoleLines.slice(-30) };
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
process.exit(out.ok ? 0 : 1);
