// Supabase Edge Function `heartbeat`: a node agent's heartbeat, so that a node stays alive through
// Supabase alone, with no self-hosted gateway.
//
// The node proves itself as it does to the gateway: `Authorization: Bearer <node secret>` (the
// secret register_node() returned once). It carries no user's JWT, so the platform's verify_jwt is
// off for this function (supabase/config.toml), and the function acts as neuralgrid_node, a role
// that may do one thing: call agent_heartbeat_with_secret(), which checks the secret in SQL before
// it records anything (supabase/migrations/20261129000200_edge_heartbeat.sql,
// 20261201000400_edge_roles.sql). No API key or user token can act as that role, and the
// service-role key is not used.
//
// The body is the agent's (neuralgrid/protocol/nodes.py Heartbeat), checked as the gateway checks
// it (./body.ts); the reply is the gateway's: {node_id, status, load}. Both paths work:
//
//   POST $SUPABASE_URL/functions/v1/heartbeat/<node id>
//   POST $SUPABASE_URL/functions/v1/heartbeat/v1/nodes/<node id>/heartbeat   (the agent's own path,
//        with $SUPABASE_URL/functions/v1/heartbeat as its gateway URL)

import postgres from "postgres";
import { asCaller, NODE_ROLE, type Sql } from "../_shared/caller.ts";
import { databaseError, error, HttpError, readJson } from "../_shared/http.ts";
import { Invalid, parseHeartbeat } from "./body.ts";

/** As the gateway's limit (neuralgrid/gateway/routes_nodes.py): a heartbeat is small. */
export const MAX_BODY_BYTES = 64 * 1024;

const NODE_PATH = /\/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?:\/heartbeat)?\/?$/i;

export function createHandler(sql: Sql): (req: Request) => Promise<Response> {
  return async (req: Request) => {
    const nodeId = NODE_PATH.exec(new URL(req.url).pathname)?.[1]?.toLowerCase();
    if (nodeId === undefined) return error(404, "POST a node's heartbeat to /functions/v1/heartbeat/<node id>");
    if (req.method !== "POST") return error(405, "POST the heartbeat as JSON");
    const secret = /^bearer\s+(\S+)\s*$/i.exec(req.headers.get("authorization") ?? "")?.[1];
    if (secret === undefined) return error(401, "send the node's secret: 'Authorization: Bearer <node secret>'");
    try {
      const beat = parseHeartbeat(await readJson(req, MAX_BODY_BYTES));
      const [reply] = await asCaller(sql, { role: NODE_ROLE }, (tx) => {
        // Objects go as jsonb values (postgres.js serializes them itself).
        const json = (value: object | null) => (value === null ? null : tx.json(value as postgres.JSONValue));
        return tx`
          select status, load
          from public.agent_heartbeat_with_secret(
            ${nodeId}::uuid, ${secret}, ${beat.status}, ${beat.queue_depth}::int, ${beat.gpu_utilization}::real,
            ${beat.free_vram_gb}::real, ${beat.models}::text[], ${json(beat.specs)}::jsonb, ${beat.backend_up},
            ${json(beat.backend)}::jsonb, ${beat.available}::text[], ${beat.loaded}::text[],
            ${json(beat.refused)}::jsonb)`;
      });
      // `load`: the models the node should pre-load now (none or one), as the gateway answers.
      return Response.json({ node_id: nodeId, status: reply.status, load: reply.load });
    } catch (err) {
      if (err instanceof HttpError) return err.response;
      if (err instanceof Invalid) return error(400, err.message, err.param);
      return databaseError(err, (status) => (status === 404 ? "node_id" : null));
    }
  };
}

if (import.meta.main) {
  // SUPABASE_DB_URL is set for every Edge Function on Supabase; the function switches to
  // neuralgrid_node in each transaction. prepare: false suits Supavisor's transaction mode.
  const sql = postgres(Deno.env.get("SUPABASE_DB_URL")!, { prepare: false });
  // PORT: to serve it outside Supabase's runtime (the test suite does), which picks its own.
  Deno.serve({ port: Number(Deno.env.get("PORT") ?? 8000) }, createHandler(sql));
}
