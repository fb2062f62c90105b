// Request validation for the web engine: the chat request's JSON schema exported from mlcc.runtime.api.protocol
// (request_schema.js, generated), checked by a small validator for the subset of JSON Schema pydantic emits, then
// the rules protocol checks in code, then what this engine can do. Every refusal is an EngineError naming the
// field (param, as OpenAI writes it: messages[0].content) and saying why; nothing is ignored silently.
import { CHAT_REQUEST_SCHEMA, MAX_DEPTH, UNSUPPORTED_FIELDS } from "./request_schema.js";

export class EngineError extends Error {
  constructor(message, param = null, code = null) {
    super(message);
    this.name = "EngineError";
    this.param = param;
    this.code = code;
  }
}

export function paramPath(path) {
  let out = "";
  for (const p of path) out += typeof p === "number" ? `[${p}]` : (out ? `.${p}` : String(p));
  return out || null;
}

export function kindOf(v) {
  if (v === null) return "null";
  if (v === undefined) return "undefined";
  if (typeof v === "boolean") return "a boolean";
  if (typeof v === "number") return Number.isInteger(v) ? "an integer" : "a number";
  if (typeof v === "string") return "a string";
  if (Array.isArray(v)) return "an array";
  if (typeof v === "object") return "an object";
  return `a ${typeof v}`;
}

function show(v) {
  if (typeof v === "string") return `'${v.length > 60 ? v.slice(0, 60) + "..." : v}'`;
  if (typeof v === "number" || typeof v === "boolean" || v === null) return JSON.stringify(v);
  return kindOf(v);
}

const TYPE_NAMES = { string: "a string", integer: "an integer", number: "a number", boolean: "a boolean",
  object: "an object", array: "an array", null: "null" };

function isObject(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

function hasType(t, v) {
  switch (t) {
    case "string": return typeof v === "string";
    case "integer": return typeof v === "number" && Number.isSafeInteger(v);
    case "number": return typeof v === "number" && Number.isFinite(v);
    case "boolean": return typeof v === "boolean";
    case "null": return v === null;
    case "object": return isObject(v);
    case "array": return Array.isArray(v);
    default: return true;
  }
}

// an error: {path, code, message(param) , expected (type errors only: merged across anyOf members)}
function typeError(path, expected, v) {
  if (typeof v === "number" && !Number.isFinite(v)) {
    return { path, code: "invalid_value", text: (p) => `Invalid '${p}': expected a finite number, but got ${v}.` };
  }
  return { path, code: "invalid_type", expected: [expected], got: v,
    text: (p) => `Invalid type for '${p}': expected ${expected}, but got ${kindOf(v)} instead.` };
}

/** The first way `v` breaks schema `s` (null if none). Handles pydantic's subset: type, anyOf, oneOf by a
 * discriminator, const, enum, properties/required/additionalProperties, items, min/maxItems, maxProperties,
 * minimum/maximum/exclusiveMinimum/exclusiveMaximum, pattern. */
export function schemaError(s, v, path = []) {
  if (s.anyOf) return anyOfError(s.anyOf, v, path);
  if (s.oneOf && s.discriminator) {
    const tag = s.discriminator;
    if (!isObject(v)) return typeError(path, "an object", v);
    const tagPath = [...path, tag];
    if (!(tag in v)) {
      return { path: tagPath, code: "missing_required_parameter", text: (p) => `Missing required parameter: '${p}'.` };
    }
    const member = s.oneOf.find((m) => m.properties[tag].const === v[tag]);
    if (!member) {
      if (typeof v[tag] !== "string") return typeError(tagPath, "a string", v[tag]);
      const tags = s.oneOf.map((m) => `'${m.properties[tag].const}'`).join(", ");
      return { path: tagPath, code: "invalid_value",
        text: () => `Invalid value: ${show(v[tag])}. Supported values are: ${tags}.` };
    }
    return schemaError(member, v, path);
  }
  if (s.type && !hasType(s.type, v)) return typeError(path, TYPE_NAMES[s.type] || s.type, v);
  if ("const" in s && v !== s.const) {
    return { path, code: "invalid_value", text: () => `Invalid value: ${show(v)}. Supported values are: '${s.const}'.` };
  }
  if (s.enum && !s.enum.includes(v)) {
    return { path, code: "invalid_value",
      text: () => `Invalid value: ${show(v)}. Supported values are: ${s.enum.map((e) => `'${e}'`).join(", ")}.` };
  }
  if (typeof v === "number") {
    const bound = (ok, op, lim) => ok ? null : { path, code: `${Number.isInteger(v) ? "integer" : "decimal"}_` +
      `${op.startsWith(">") ? "below_min" : "above_max"}_value`,
    text: (p) => `Invalid '${p}': ${Number.isInteger(v) ? "integer" : "decimal"} ` +
      `${op.startsWith(">") ? "below minimum" : "above maximum"} value. Expected a value ${op} ${lim}, but got ${v} ` +
      "instead." };
    const e = ("minimum" in s && bound(v >= s.minimum, ">=", s.minimum)) ||
      ("maximum" in s && bound(v <= s.maximum, "<=", s.maximum)) ||
      ("exclusiveMinimum" in s && bound(v > s.exclusiveMinimum, ">", s.exclusiveMinimum)) ||
      ("exclusiveMaximum" in s && bound(v < s.exclusiveMaximum, "<", s.exclusiveMaximum));
    if (e) return e;
  }
  if (typeof v === "string" && s.pattern && !new RegExp(s.pattern, "u").test(v)) {
    return { path, code: "invalid_value", text: (p) => `Invalid '${p}': string does not match pattern. Expected a ` +
      `string that matches the pattern '${s.pattern}'.` };
  }
  if (Array.isArray(v)) {
    if ("minItems" in s && v.length < s.minItems) {
      return { path, code: s.minItems === 1 ? "empty_array" : "array_below_min_length",
        text: (p) => `Invalid '${p}': expected ${s.minItems === 1 ? "a non-empty array" : `at least ${s.minItems} items`}` +
          `, but got ${v.length}.` };
    }
    if ("maxItems" in s && v.length > s.maxItems) {
      return { path, code: "array_above_max_length",
        text: (p) => `Invalid '${p}': expected at most ${s.maxItems} items, but got ${v.length}.` };
    }
    if (s.items) {
      for (let i = 0; i < v.length; i++) {
        const e = schemaError(s.items, v[i], [...path, i]);
        if (e) return e;
      }
    }
  }
  if (isObject(v)) {
    const keys = Object.keys(v).filter((k) => v[k] !== undefined);
    if ("maxProperties" in s && keys.length > s.maxProperties) {
      return { path, code: "array_above_max_length",
        text: (p) => `Invalid '${p}': expected at most ${s.maxProperties} items, but got ${keys.length}.` };
    }
    const props = s.properties || {};
    for (const k of keys) {
      if (k in props) continue;
      if (s.additionalProperties === false) {
        return { path: [...path, k], code: "unknown_parameter", text: (p) => `Unknown parameter: '${p}'.` };
      }
    }
    for (const k of s.required || []) {
      if (v[k] === undefined) {
        return { path: [...path, k], code: "missing_required_parameter",
          text: (p) => `Missing required parameter: '${p}'.` };
      }
    }
    for (const k of keys) {
      const sub = k in props ? props[k] : (isObject(s.additionalProperties) ? s.additionalProperties : null);
      if (!sub) continue;
      const e = schemaError(sub, v[k], [...path, k]);
      if (e) return e;
    }
  }
  return null;
}

function anyOfError(members, v, path) {
  const errs = [];
  for (const m of members) {
    const e = schemaError(m, v, path);
    if (!e) return null;
    errs.push(e);
  }
  // no member matched: the one that got furthest into the value speaks; type errors at this very spot merge
  const deepest = Math.max(...errs.map((e) => e.path.length));
  const here = errs.filter((e) => e.path.length === path.length && e.expected);
  if (deepest === path.length && here.length === errs.length) {
    const wanted = [...new Set(here.flatMap((e) => e.expected))].sort();
    const expected = wanted.length === 1 ? wanted[0] : "one of " + wanted.join(" or ");
    return { path, code: "invalid_type", expected: wanted,
      text: (p) => `Invalid type for '${p}': expected ${expected}, but got ${kindOf(v)} instead.` };
  }
  return errs.find((e) => e.path.length === deepest);
}

function fail(message, param, code = "invalid_value") {
  throw new EngineError(message, param, code);
}

// nesting and strings as protocol's json_body.check_values: no deeper than MAX_DEPTH, no lone UTF-16 surrogates
function checkValues(req) {
  const stack = [[req, [], 0]];
  const wellFormed = (s) => (s.isWellFormed ? s.isWellFormed() : !/[\uD800-\uDFFF]/.test(s.normalize()));
  while (stack.length) {
    const [v, path, depth] = stack.pop();
    if (depth > MAX_DEPTH) fail(`the request nests deeper than ${MAX_DEPTH} levels`, paramPath(path), "invalid_json");
    if (typeof v === "string" && !wellFormed(v)) {
      fail(`Invalid '${paramPath(path)}': the string holds a lone UTF-16 surrogate`, paramPath(path));
    }
    if (v !== null && typeof v === "object") {
      for (const [k, x] of Object.entries(v)) {
        const at = [...path, Array.isArray(v) ? Number(k) : k];
        if (!Array.isArray(v) && !wellFormed(k)) fail("a key holds a lone UTF-16 surrogate", paramPath(path));
        stack.push([x, at, depth + 1]);
      }
    }
  }
}

/** The request as protocol.parse_chat_request would take it (a copy without undefined fields), or EngineError. */
export function parseChatRequest(req) {
  if (!isObject(req)) fail(`the request must be an object, got ${kindOf(req)}`, null, "invalid_type");
  req = Object.fromEntries(Object.entries(req).filter(([, v]) => v !== undefined));
  checkValues(req);
  for (const k of Object.keys(req)) {
    if (k in UNSUPPORTED_FIELDS) fail(`'${k}' is not supported: ${UNSUPPORTED_FIELDS[k]}`, k, "unsupported_parameter");
  }
  (Array.isArray(req.messages) ? req.messages : []).forEach((m, i) => {
    for (const [j, part] of (isObject(m) && Array.isArray(m.content) ? m.content : []).entries()) {
      const kind = isObject(part) ? part.type : null;
      if (typeof kind === "string" && kind !== "text") {
        fail(`content part type '${kind}' is not supported: this engine serves text-only models; send text parts ` +
          "({type: \"text\", text: ...}) or a string", `messages[${i}].content`, "invalid_value");
      }
    }
  });
  const e = schemaError(CHAT_REQUEST_SCHEMA, req);
  if (e) {
    const p = paramPath(e.path);
    fail(e.text(p), p, e.code);
  }
  checkRules(req);
  return req;
}

// what protocol checks in code rather than in the schema (its field validators and _check_* functions)
function checkRules(req) {
  if (req.stop != null) {
    const stops = typeof req.stop === "string" ? [req.stop] : req.stop;
    if (stops.length > 4 || !stops.every((s) => s)) {
      fail("Invalid 'stop': expected a non-empty string or a list of at most 4 non-empty strings", "stop");
    }
  }
  for (const [k, b] of Object.entries(req.logit_bias || {})) {
    if (!/^[0-9]{1,10}$/.test(k) || Number(k) > 2147483647) {
      fail(`Invalid 'logit_bias': keys must be token ids (non-negative integers as strings), got '${k.slice(0, 40)}'`,
        "logit_bias");
    }
    if (!(b >= -100 && b <= 100)) fail(`Invalid 'logit_bias': values must be in [-100, 100], got ${b} for token ${k}`,
      "logit_bias");
  }
  if (req.top_logprobs != null && !req.logprobs) fail("top_logprobs needs logprobs: true", "top_logprobs");
  if (req.stream_options != null && "stream" in req && !req.stream) {
    fail("stream_options is only allowed with stream: true", "stream_options");
  }
  if (req.structured_outputs != null && Object.keys(req.structured_outputs).length !== 1) {
    fail("structured_outputs takes exactly one of json, regex, choice, grammar", "structured_outputs");
  }
  if (req.structured_outputs != null && req.response_format != null && req.response_format.type !== "text") {
    fail("response_format and structured_outputs both constrain the output: send one of them", "structured_outputs");
  }
  const tools = req.tools || [];
  if (!tools.length && req.tool_choice != null && req.tool_choice !== "none") {
    fail("tool_choice is only allowed when tools are specified", "tool_choice");
  }
  if (!tools.length && req.parallel_tool_calls != null) {
    fail("parallel_tool_calls is only allowed when tools are specified", "parallel_tool_calls");
  }
  let openCalls = new Set();
  req.messages.forEach((m, i) => {
    if (m.role === "assistant") {
      if (m.content == null && !(m.tool_calls && m.tool_calls.length)) {
        fail(`messages[${i}] (assistant) needs content or tool_calls`, `messages[${i}].content`);
      }
      openCalls = new Set((m.tool_calls || []).map((c) => c.id));
    } else if (m.role === "tool") {
      if (!openCalls.size) {
        fail(`messages[${i}]: a message with role 'tool' must answer a preceding assistant message with 'tool_calls'`,
          `messages[${i}].role`);
      }
      if (!openCalls.has(m.tool_call_id)) {
        fail(`messages[${i}].tool_call_id '${m.tool_call_id.slice(0, 64)}' is none of the preceding assistant ` +
          "message's tool call ids", `messages[${i}].tool_call_id`);
      }
    } else {
      openCalls = new Set();
    }
  });
}

/** What this engine cannot do with a valid request: EngineError naming the field. caps: {vocab, grammars}. */
export function checkWebSupport(req, caps) {
  const unsupported = (param, why) => fail(`${param} is not supported by the web engine yet: ${why}`, param,
    "unsupported_parameter");
  if (req.n != null && req.n !== 1) fail("n must be 1 in the web engine (it runs one sequence at a time)", "n",
    "unsupported_value");
  if (req.tools && req.tools.length) {
    unsupported("tools", "tool calls need a tool-call grammar and parser, which only the Python engine has " +
      "(mlcc serve)");
  }
  const rf = req.response_format;
  if (rf && rf.type !== "text" && !caps.grammars) {
    unsupported("response_format", `${rf.type} needs a grammar engine; this site has no vendor/xgrammar.js ` +
      "(rebuild it with mlcc web)");
  }
  const so = req.structured_outputs;
  if (so && !caps.grammars) {
    unsupported("structured_outputs", "it needs a grammar engine; this site has no vendor/xgrammar.js " +
      "(rebuild it with mlcc web)");
  }
  if (so && so.grammar != null && !so.grammar.includes("::=")) {
    unsupported("structured_outputs.grammar", "Lark grammars need llguidance (the Python engine); send GBNF/EBNF " +
      "(rules written with ::=)");
  }
  for (const [k] of Object.entries(req.logit_bias || {})) {
    if (Number(k) >= caps.vocab) {
      fail(`logit_bias: token ${k} is not in this model's vocabulary [0, ${caps.vocab})`, "logit_bias");
    }
  }
  for (const t of req.stop_token_ids || []) {
    if (t >= caps.vocab) fail(`stop_token_ids: ${t} is not in this model's vocabulary [0, ${caps.vocab})`,
      "stop_token_ids");
  }
}
