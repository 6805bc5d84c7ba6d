// Acting as the caller in the database, exactly as PostgREST does for the Data API: each request's
// queries run in one transaction that first switches to the JWT's role and sets request.jwt.claims,
// so that role's grants and the RLS policies (auth.uid(), auth.jwt()) decide what it may do. Both
// settings are transaction-local: they end with the transaction, and the pooled connection goes
// back to the next request as it came (as `postgres`, from SUPABASE_DB_URL).
//
// Why not a supabase-js client holding the caller's Authorization header (Supabase's own pattern)?
// That sends every query through PostgREST; this does what PostgREST does, on the connection the
// function already has: one hop less, the same roles, grants and policies, and a transaction
// around the request. It also runs where PostgREST does not (the embedded stack, the tests).

import type postgres from "postgres";
import type { Claims } from "./auth.ts";

export type Sql = postgres.Sql;
export type Tx = postgres.TransactionSql;

/** Roles of ours that no token can claim (auth.ts accepts only ROLES) and no Data API request can
 * become, each granted one function (20261201000400_edge_roles.sql): a node's heartbeat, and the
 * ranking `match` runs for a signed-in user. */
export const NODE_ROLE = "neuralgrid_node";
export const MATCHER_ROLE = "neuralgrid_matcher";

/** Who the database sees: a verified caller's claims, with their API role or one of ours. */
export type Caller = Omit<Claims, "role"> & { role: Claims["role"] | typeof NODE_ROLE | typeof MATCHER_ROLE };

/** Runs `work` in a transaction as the caller: `set local role <claims.role>` and
 * `request.jwt.claims`, as PostgREST sets them. The role is one of ROLES (auth.ts checked it), or
 * one of ours (NODE_ROLE, MATCHER_ROLE) that a function chose for a caller it verified. */
export async function asCaller<T>(sql: Sql, claims: Caller, work: (tx: Tx) => Promise<T>): Promise<T> {
  const result = await sql.begin(async (tx) => {
    // set_config('role', …, true) is `set local role`, with the role as a parameter (PostgREST's way).
    await tx`select set_config('role', ${claims.role}, true),
                    set_config('request.jwt.claims', ${JSON.stringify(claims)}, true)`;
    return await work(tx);
  });
  return result as T;
}
