// asCaller() runs queries as the caller, as PostgREST does: the role's grants and the RLS policies
// (auth.uid()) decide, and the connection is `postgres` again once the transaction ends.

import { asCaller } from "./caller.ts";
import { assert, assertEquals, connect, makeUser } from "./testing.ts";

async function sqlstate(work: () => Promise<unknown>): Promise<string | undefined> {
  try {
    await work();
  } catch (err) {
    return (err as { code?: string }).code;
  }
  return undefined;
}

Deno.test("as the caller: grants and RLS decide, auth.uid() is the caller, postgres again afterwards", async () => {
  const sql = connect(1); // one connection: what the transaction leaves behind shows
  try {
    const alice = await makeUser(sql, "alice@example.test");
    const bob = await makeUser(sql, "bob@example.test");
    const aliceClaims = { role: "authenticated" as const, sub: alice.id };
    const bobClaims = { role: "authenticated" as const, sub: bob.id };
    // create_api_key() makes a key for auth.uid(): the claims reach the database.
    await asCaller(sql, aliceClaims, (tx) => tx`select id from public.create_api_key('alice key')`);
    await asCaller(sql, bobClaims, (tx) => tx`select id from public.create_api_key('bob key')`);
    const owners = await sql`select k.name, u.email from public.api_keys k join auth.users u on u.id = k.owner_id order by 1`;
    assertEquals(owners.map((r) => `${r.name}:${r.email}`), ["alice key:alice@example.test", "bob key:bob@example.test"]);

    // RLS: each user sees only their own key; the column grants hide the hash from everyone.
    const seen = await asCaller(sql, aliceClaims, (tx) => tx`select name from public.api_keys`);
    assertEquals(seen.map((r) => r.name), ["alice key"]);
    assertEquals(await sqlstate(() => asCaller(sql, aliceClaims, (tx) => tx`select key_hash from public.api_keys`)), "42501");
    // A user cannot revoke another's key: the policy finds no row.
    const revoked = await asCaller(sql, bobClaims, (tx) => tx`update public.api_keys set revoked_at = now() where name = 'alice key' returning id`);
    assertEquals(revoked.length, 0);

    // anon: no keys at all, and no private helper; the map is public.
    assertEquals(await sqlstate(() => asCaller(sql, { role: "anon" }, (tx) => tx`select id from public.api_keys`)), "42501");
    assertEquals(await sqlstate(() => asCaller(sql, { role: "anon" }, (tx) => tx`select private.great_circle_km(0, 0, 1, 1)`)), "42501");
    await asCaller(sql, { role: "anon" }, (tx) => tx`select count(*) from public.node_map`);

    // service_role bypasses RLS, as on Supabase.
    const all = await asCaller(sql, { role: "service_role" }, (tx) => tx`select name from public.api_keys`);
    assertEquals(all.length, 2);

    // Inside: the role and claims PostgREST would set. After: postgres, no claims.
    const [inside] = await asCaller(sql, aliceClaims, (tx) =>
      tx`select current_user as role, auth.uid()::text as uid, auth.role() as claimed`
    );
    assertEquals(inside, { role: "authenticated", uid: alice.id, claimed: "authenticated" });
    const [after] = await sql`select current_user as role, coalesce(current_setting('request.jwt.claims', true), '') as claims`;
    assertEquals(after, { role: "postgres", claims: "" });

    // A failure rolls the whole request back, and the role ends with it too.
    const before = await sql`select count(*)::int as n from public.api_keys`;
    const failed = await sqlstate(() =>
      asCaller(sql, aliceClaims, async (tx) => {
        await tx`select id from public.create_api_key('half-made')`;
        await tx`select 1 / 0`;
      })
    );
    assertEquals(failed, "22012");
    assertEquals(await sql`select count(*)::int as n from public.api_keys`, before);
    const [role] = await sql`select current_user as role`;
    assert(role.role === "postgres", `after a failure: ${role.role}`);
  } finally {
    await sql.end();
  }
});
