// The heartbeat body, checked as the gateway checks it (neuralgrid/protocol/nodes.py, Heartbeat):
// the same fields, defaults, ranges and lengths, unknown fields refused. One difference: the
// gateway's pydantic coerces ("5" for 5); this takes JSON's own types only, as agents send them.
// tests/web/test_edge_functions.py runs the same bodies through both and compares.

/** The OpenAI routes a node may serve (neuralgrid/protocol/routes.py). */
export const ROUTES = [
  "chat/completions",
  "completions",
  "embeddings",
  "responses",
  "rerank",
  "score",
  "audio/transcriptions",
  "audio/translations",
  "audio/speech",
] as const;

export const STATUSES = ["online", "draining", "offline"] as const;

export interface BackendInfo {
  kind: string;
  version: string | null;
  parallel: number | null;
  usage_in_streams: boolean;
  continues: boolean;
  echoes: boolean;
  tokenize: boolean;
  interrupts: boolean;
  routes: string[] | null;
}

export interface Specs {
  gpu_model: string;
  gpu_count: number;
  vram_gb: number;
  tflops: number;
  max_concurrency: number | null; // the requests its server runs at once, when that changed
}

export interface Heartbeat {
  status: typeof STATUSES[number];
  queue_depth: number;
  gpu_utilization: number | null;
  free_vram_gb: number | null;
  models: string[];
  specs: Specs | null;
  backend_up: boolean;
  backend: BackendInfo | null;
  available: string[] | null;
  loaded: string[];
  refused: { model: string; reason: string }[];
}

export const HEARTBEAT_FIELDS = [
  "status",
  "queue_depth",
  "gpu_utilization",
  "free_vram_gb",
  "models",
  "specs",
  "backend_up",
  "backend",
  "available",
  "loaded",
  "refused",
] as const;

/** A refused body: what is wrong, and where (the parameter's path, e.g. `specs.vram_gb`). */
export class Invalid extends Error {
  constructor(readonly param: string | null, message: string) {
    super(param ? `${param}: ${message}` : message);
  }
}

type Json = Record<string, unknown>;

// Printable text: no control characters (Postgres cannot even hold NUL).
// deno-lint-ignore no-control-regex
const PRINTABLE = /^[^\x00-\x1f\x7f]*$/;

function object(value: unknown, at: string | null, fields: readonly string[]): Json {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new Invalid(at, "must be a JSON object");
  }
  const extra = Object.keys(value).find((key) => !fields.includes(key));
  if (extra !== undefined) throw new Invalid(at ? `${at}.${extra}` : extra, "extra fields are not permitted");
  return value as Json;
}

function text(value: unknown, at: string, min: number, max: number): string {
  if (typeof value !== "string") throw new Invalid(at, "must be a string");
  const length = [...value].length; // characters, as Python counts them
  if (length < min || length > max) throw new Invalid(at, `must be ${min} to ${max} characters long`);
  if (!PRINTABLE.test(value)) throw new Invalid(at, "must not contain control characters");
  return value;
}

function number(value: unknown, at: string, range: { gt?: number; ge?: number; le: number }, integer = false): number {
  if (typeof value !== "number" || !Number.isFinite(value)) throw new Invalid(at, "must be a number");
  if (integer && !Number.isInteger(value)) throw new Invalid(at, "must be an integer");
  if (range.gt !== undefined && !(value > range.gt)) throw new Invalid(at, `must be greater than ${range.gt}`);
  if (range.ge !== undefined && !(value >= range.ge)) throw new Invalid(at, `must be at least ${range.ge}`);
  if (!(value <= range.le)) throw new Invalid(at, `must be at most ${range.le}`);
  return value;
}

function boolean(value: unknown, at: string): boolean {
  if (typeof value !== "boolean") throw new Invalid(at, "must be true or false");
  return value;
}

function list<T>(value: unknown, at: string, max: number, item: (v: unknown, at: string) => T, min = 0): T[] {
  if (!Array.isArray(value)) throw new Invalid(at, "must be a list");
  if (value.length < min || value.length > max) throw new Invalid(at, `must hold ${min} to ${max} items`);
  return value.map((v, i) => item(v, `${at}.${i}`));
}

const modelName = (v: unknown, at: string) => text(v, at, 1, 256);
const slots = (v: unknown, at: string) => number(v, at, { ge: 1, le: 1024 }, true); // requests at once
const unique = <T>(items: T[]): T[] => [...new Set(items)];

function specs(value: unknown): Specs {
  const s = object(value, "specs", ["gpu_model", "gpu_count", "vram_gb", "tflops", "max_concurrency"]);
  return {
    gpu_model: text(s.gpu_model, "specs.gpu_model", 1, 100),
    gpu_count: number(s.gpu_count, "specs.gpu_count", { ge: 1, le: 64 }, true),
    vram_gb: number(s.vram_gb, "specs.vram_gb", { gt: 0, le: 8192 }),
    tflops: number(s.tflops, "specs.tflops", { gt: 0, le: 100_000 }),
    max_concurrency: s.max_concurrency == null ? null : slots(s.max_concurrency, "specs.max_concurrency"),
  };
}

const BACKEND_FIELDS = [
  "kind",
  "version",
  "parallel",
  "usage_in_streams",
  "continues",
  "echoes",
  "tokenize",
  "interrupts",
  "routes",
];

function backend(value: unknown): BackendInfo {
  const b = object(value, "backend", BACKEND_FIELDS);
  const flag = (key: string) => (b[key] === undefined ? false : boolean(b[key], `backend.${key}`));
  const route = (v: unknown, at: string) => {
    if (!(ROUTES as readonly unknown[]).includes(v)) throw new Invalid(at, `must be one of ${ROUTES.join(", ")}`);
    return v as string;
  };
  return {
    kind: text(b.kind, "backend.kind", 1, 32),
    version: b.version == null ? null : text(b.version, "backend.version", 0, 64),
    parallel: b.parallel == null ? null : slots(b.parallel, "backend.parallel"),
    usage_in_streams: flag("usage_in_streams"),
    continues: flag("continues"),
    echoes: flag("echoes"),
    tokenize: flag("tokenize"),
    interrupts: flag("interrupts"),
    routes: b.routes == null ? null : unique(list(b.routes, "backend.routes", 32, route, 1)),
  };
}

/** The heartbeat in `body`, with the gateway's defaults; Invalid when the gateway would refuse it. */
export function parseHeartbeat(body: unknown): Heartbeat {
  const h = object(body, null, HEARTBEAT_FIELDS);
  const status = h.status === undefined ? "online" : h.status;
  if (!(STATUSES as readonly unknown[]).includes(status)) {
    throw new Invalid("status", `must be one of ${STATUSES.join(", ")}`);
  }
  const refusal = (v: unknown, at: string) => {
    const r = object(v, at, ["model", "reason"]);
    return { model: modelName(r.model, `${at}.model`), reason: text(r.reason, `${at}.reason`, 1, 200) };
  };
  return {
    status: status as Heartbeat["status"],
    queue_depth: h.queue_depth === undefined ? 0 : number(h.queue_depth, "queue_depth", { ge: 0, le: 1_000_000 }, true),
    gpu_utilization: h.gpu_utilization == null ? null : number(h.gpu_utilization, "gpu_utilization", { ge: 0, le: 1 }),
    free_vram_gb: h.free_vram_gb == null ? null : number(h.free_vram_gb, "free_vram_gb", { ge: 0, le: 100_000 }),
    models: h.models === undefined ? [] : unique(list(h.models, "models", 1000, modelName)),
    specs: h.specs == null ? null : specs(h.specs),
    backend_up: h.backend_up === undefined ? true : boolean(h.backend_up, "backend_up"),
    backend: h.backend == null ? null : backend(h.backend),
    available: h.available == null ? null : unique(list(h.available, "available", 1000, modelName)),
    loaded: h.loaded === undefined ? [] : list(h.loaded, "loaded", 16, modelName),
    refused: h.refused === undefined ? [] : list(h.refused, "refused", 16, refusal),
  };
}
