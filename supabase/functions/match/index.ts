// Supabase Edge Function `match`: the node ranking of score_nodes(), over HTTP.
//
// For tools that want to see where a request would go without sending it (dashboards, the map,
// a node owner checking their price). Supabase verifies the caller's JWT before this runs; the
// function reads only what score_nodes() returns, which is public map data.
//
//   curl -X POST "$SUPABASE_URL/functions/v1/match" -H "Authorization: Bearer $ANON_KEY" \
//        -d '{"model": "meta-llama/Llama-3.1-8B-Instruct", "region": "eu-west", "limit": 5}'

import postgres from "postgres";

type Sql = ReturnType<typeof postgres>;

interface MatchQuery {
  model: string;
  min_vram_gb?: number | null;
  policy?: string;
  region?: string | null;
  latitude?: number | null;
  longitude?: number | null;
  max_hourly_rate?: number | null;
  explain?: boolean;
  limit?: number | null;
}

const SQLSTATE_STATUS: Record<string, number> = {
  P0002: 404, // unknown model
  "22023": 400, // invalid parameter (policy, VRAM, coordinates, limit)
  "22P02": 400,
};

function error(status: number, message: string, param: string | null = null): Response {
  const type = status >= 500 ? "server_error" : "invalid_request_error";
  return Response.json({ error: { message, type, param, code: null } }, { status });
}

function parse(body: unknown): MatchQuery | string {
  if (typeof body !== "object" || body === null || Array.isArray(body)) return "the body must be a JSON object";
  const q = body as Record<string, unknown>;
  if (typeof q.model !== "string" || q.model.length === 0) return "model: a model id is required";
  for (const key of ["min_vram_gb", "latitude", "longitude", "max_hourly_rate", "limit"]) {
    if (q[key] !== undefined && q[key] !== null && typeof q[key] !== "number") return `${key}: must be a number`;
  }
  for (const key of ["policy", "region"]) {
    if (q[key] !== undefined && q[key] !== null && typeof q[key] !== "string") return `${key}: must be a string`;
  }
  return q as unknown as MatchQuery;
}

export function createHandler(sql: Sql): (req: Request) => Promise<Response> {
  return async (req: Request) => {
    if (req.method !== "POST") return error(405, "POST a JSON body: {model, region?, limit?, ...}");
    let body: unknown;
    try {
      body = await req.json();
    } catch {
      return error(400, "the body is not valid JSON");
    }
    const q = parse(body);
    if (typeof q === "string") return error(400, q, q.split(":")[0]);
    try {
      const rows = await sql`
        select node_id, name, rank, score, fit, compute, price, warm, capacity, reputation, proximity,
               reject_reason
        from public.score_nodes(${q.model}, ${q.min_vram_gb ?? null}::real, ${q.policy ?? "balanced"},
                                ${q.region ?? null}, ${q.latitude ?? null}::float8,
                                ${q.longitude ?? null}::float8, ${q.max_hourly_rate ?? null}::numeric,
                                ${q.explain ?? false}, ${q.limit ?? null}::int)`;
      return Response.json({ object: "list", model: q.model, data: rows });
    } catch (err) {
      const code = (err as { code?: string }).code ?? "";
      const status = SQLSTATE_STATUS[code];
      if (status) return error(status, (err as Error).message, status === 404 ? "model" : null);
      throw err;
    }
  };
}

if (import.meta.main) {
  // SUPABASE_DB_URL is set for every Edge Function on Supabase; prepare: false suits Supavisor.
  const sql = postgres(Deno.env.get("SUPABASE_DB_URL")!, { prepare: false });
  Deno.serve(createHandler(sql));
}
