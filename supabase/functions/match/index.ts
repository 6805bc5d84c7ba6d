// Supabase Edge Function `match`: the node ranking of score_nodes(), over HTTP, as the caller.
//
// For tools that want to see where a request would go without sending it (dashboards, the map,
// a node owner checking their price). The function verifies the caller's JWT or API key itself
// (../_shared/auth.ts): signed-in users and the service may rank nodes, anon gets 403. score_nodes()
// runs as its owner, so no Data API role may call it (Supabase's lint 0029): a user's ranking runs
// as neuralgrid_matcher, a role that may call score_nodes() and nothing else, with the user's
// claims; the service's as service_role (../_shared/caller.ts, 20261201000400_edge_roles.sql).
//
//   curl -X POST "$SUPABASE_URL/functions/v1/match" -H "Authorization: Bearer $USER_JWT" \
//        -d '{"model": "meta-llama/Llama-3.1-8B-Instruct", "region": "eu-west", "limit": 5}'

import postgres from "postgres";
import { Authenticator } from "../_shared/auth.ts";
import { asCaller, type Caller, MATCHER_ROLE, type Sql } from "../_shared/caller.ts";
import { databaseError, error, HttpError, readJson } from "../_shared/http.ts";

const MAX_BODY_BYTES = 16 * 1024;

interface MatchQuery {
  model: string;
  min_vram_gb?: number | null;
  policy?: string | null;
  region?: string | null;
  latitude?: number | null;
  longitude?: number | null;
  max_hourly_rate?: number | null;
  explain?: boolean | null;
  limit?: number | null;
  route?: string | null;
}

const NUMBERS = ["min_vram_gb", "latitude", "longitude", "max_hourly_rate", "limit"];
// A place on the globe (score_nodes() ranked every node NaN from one off it).
const RANGES: Record<string, [number, number]> = { latitude: [-90, 90], longitude: [-180, 180] };
const STRINGS = ["policy", "region", "route"];
const FIELDS = new Set(["model", "explain", ...NUMBERS, ...STRINGS]);

function parse(body: unknown): MatchQuery | string {
  if (typeof body !== "object" || body === null || Array.isArray(body)) return "the body must be a JSON object";
  const q = body as Record<string, unknown>;
  const unknown = Object.keys(q).find((key) => !FIELDS.has(key));
  if (unknown !== undefined) return `${unknown}: not a parameter of match`;
  if (typeof q.model !== "string" || q.model.length === 0) return "model: a model id is required";
  for (const key of NUMBERS) {
    const value = q[key];
    if (value === undefined || value === null) continue;
    if (typeof value !== "number" || !Number.isFinite(value)) return `${key}: must be a number`;
    const range = RANGES[key];
    if (range && (value < range[0] || value > range[1])) return `${key}: must be between ${range[0]} and ${range[1]}`;
  }
  for (const key of STRINGS) {
    if (q[key] !== undefined && q[key] !== null && typeof q[key] !== "string") return `${key}: must be a string`;
  }
  if (q.explain !== undefined && q.explain !== null && typeof q.explain !== "boolean") {
    return "explain: must be true or false";
  }
  return q as unknown as MatchQuery;
}

export function createHandler(sql: Sql, auth: Authenticator): (req: Request) => Promise<Response> {
  return async (req: Request) => {
    if (req.method !== "POST") return error(405, "POST a JSON body: {model, region?, limit?, ...}");
    try {
      const caller = await auth.caller(req);
      if (caller.role === "anon") return error(403, "ranking nodes needs a signed-in user's token or the service key");
      const q = parse(await readJson(req, MAX_BODY_BYTES));
      if (typeof q === "string") return error(400, q, q.split(":")[0]);
      const as: Caller = caller.role === "authenticated" ? { ...caller, role: MATCHER_ROLE } : caller;
      const rows = await asCaller(sql, as, (tx) =>
        tx`
          select node_id, name, rank, score, fit, compute, price, warm, capacity, reputation, proximity,
                 reserve, reject_reason
          from public.score_nodes(${q.model}, ${q.min_vram_gb ?? null}::real, ${q.policy ?? "balanced"},
                                  ${q.region ?? null}, ${q.latitude ?? null}::float8,
                                  ${q.longitude ?? null}::float8, ${q.max_hourly_rate ?? null}::numeric,
                                  ${q.explain ?? false}, ${q.limit ?? null}::int, ${q.route ?? null})`
      );
      return Response.json({ object: "list", model: q.model, data: rows });
    } catch (err) {
      if (err instanceof HttpError) return err.response;
      return databaseError(err, (status) => (status === 404 ? "model" : null));
    }
  };
}

if (import.meta.main) {
  // SUPABASE_DB_URL is set for every Edge Function on Supabase (it connects as `postgres`, which
  // then acts as each caller); prepare: false suits Supavisor's transaction mode.
  const sql = postgres(Deno.env.get("SUPABASE_DB_URL")!, { prepare: false });
  Deno.serve(createHandler(sql, Authenticator.fromEnv()));
}
