-- The platform's functions never JIT-compile. Postgres compiles a statement with LLVM when its
-- planned cost passes jit_above_cost (100,000), as it is on by default wherever Postgres is built
-- with LLVM (Debian's and most packaged builds, not the embedded default's). The sweep's statements
-- pass it even on an empty database: on Debian's PostgreSQL 15 each public.sweep() took 1.6 to 2.0 s
-- of compiling for 7 ms of work, every second; planned costs grow with the tables, so more
-- statements pass it in a big fleet. Every call is a short transaction, so each function the
-- gateway, the agents, the web pages, the Data API and pg_cron call is set jit off; what it runs
-- inside (the sweep's steps, triggers) runs with it. tests/db/test_no_jit.py keeps every such
-- function so.

ALTER FUNCTION public.agent_heartbeat(uuid,bytea,text,integer,real,real,text[],jsonb) SET jit TO 'off';
ALTER FUNCTION public.agent_heartbeat(uuid,bytea,text,integer,real,real,text[],jsonb,boolean,jsonb) SET jit TO 'off';
ALTER FUNCTION public.agent_heartbeat(uuid,bytea,text,integer,real,real,text[],jsonb,boolean,jsonb,text[],text[],jsonb) SET jit TO 'off';
ALTER FUNCTION public.agent_heartbeat_with_secret(uuid,text,text,integer,real,real,text[],jsonb,boolean,jsonb,text[],text[],jsonb) SET jit TO 'off';
ALTER FUNCTION public.attach_tunnel(uuid,uuid,uuid) SET jit TO 'off';
ALTER FUNCTION public.complete_job(uuid,text,integer,integer,real,real,text) SET jit TO 'off';
ALTER FUNCTION public.complete_jobs(uuid[],text[],integer[],integer[],real[],real[],text[]) SET jit TO 'off';
ALTER FUNCTION public.continuing_nodes(uuid[]) SET jit TO 'off';
ALTER FUNCTION public.create_api_key(text,integer,integer,numeric) SET jit TO 'off';
ALTER FUNCTION public.detach_tunnel(uuid,uuid) SET jit TO 'off';
ALTER FUNCTION public.due_challenges(text[],integer) SET jit TO 'off';
ALTER FUNCTION public.due_cross_checks(text[],integer) SET jit TO 'off';
ALTER FUNCTION public.due_gpu_probes(integer) SET jit TO 'off';
ALTER FUNCTION public.failover_job(uuid,text,integer,uuid[]) SET jit TO 'off';
ALTER FUNCTION public.fleet_stats() SET jit TO 'off';
ALTER FUNCTION public.gateway_alive(uuid) SET jit TO 'off';
ALTER FUNCTION public.gateway_alive(uuid,text) SET jit TO 'off';
ALTER FUNCTION public.gateway_alive(uuid,text,jsonb) SET jit TO 'off';
ALTER FUNCTION public.handoff_job(uuid,text,integer,uuid[]) SET jit TO 'off';
ALTER FUNCTION public.handoff_job(uuid,text,uuid[]) SET jit TO 'off';
ALTER FUNCTION public.map_summary(boolean) SET jit TO 'off';
ALTER FUNCTION public.map_view(double precision,double precision,double precision,double precision,double precision,integer) SET jit TO 'off';
ALTER FUNCTION public.match_job(text,uuid,text,real,text,double precision,double precision,numeric,boolean,integer,integer,integer) SET jit TO 'off';
ALTER FUNCTION public.match_job(text,uuid,text,real,text,double precision,double precision,numeric,boolean,integer,numeric) SET jit TO 'off';
ALTER FUNCTION public.move_to_lease(uuid,text,integer,uuid) SET jit TO 'off';
ALTER FUNCTION public.my_earnings(timestamp with time zone) SET jit TO 'off';
ALTER FUNCTION public.my_earnings_totals(timestamp with time zone) SET jit TO 'off';
ALTER FUNCTION public.my_model_checks() SET jit TO 'off';
ALTER FUNCTION public.my_node_stats(interval) SET jit TO 'off';
ALTER FUNCTION public.my_nodes() SET jit TO 'off';
ALTER FUNCTION public.node_heartbeat(uuid,text[]) SET jit TO 'off';
ALTER FUNCTION public.node_heartbeats(jsonb) SET jit TO 'off';
ALTER FUNCTION public.node_list(text,text,boolean,integer,integer) SET jit TO 'off';
ALTER FUNCTION public.place_challenge(text,uuid,text,boolean) SET jit TO 'off';
ALTER FUNCTION public.place_job(text,uuid,text,real,text,double precision,double precision,numeric,boolean,integer,integer,integer,boolean) SET jit TO 'off';
ALTER FUNCTION public.place_job(text,uuid,text,real,text,double precision,double precision,numeric,boolean,integer,integer,integer,boolean,text) SET jit TO 'off';
ALTER FUNCTION public.place_jobs(text,jsonb) SET jit TO 'off';
ALTER FUNCTION public.record_challenges(jsonb) SET jit TO 'off';
ALTER FUNCTION public.record_gpu_probe(uuid,text,jsonb) SET jit TO 'off';
ALTER FUNCTION public.record_jobs(uuid,jsonb) SET jit TO 'off';
ALTER FUNCTION public.register_node(uuid,text,text,integer,real,real,numeric,text,double precision,double precision,text,integer,text[],text,uuid) SET jit TO 'off';
ALTER FUNCTION public.register_node(uuid,text,text,integer,real,real,numeric,text,double precision,double precision,text,integer,text[],text,uuid,jsonb) SET jit TO 'off';
ALTER FUNCTION public.reject_job(uuid,text,integer) SET jit TO 'off';
ALTER FUNCTION public.renew_escrows(uuid,jsonb) SET jit TO 'off';
ALTER FUNCTION public.renew_leases(uuid,jsonb) SET jit TO 'off';
ALTER FUNCTION public.request_verification(uuid) SET jit TO 'off';
ALTER FUNCTION public.restore_tunnels(uuid,uuid[],uuid[]) SET jit TO 'off';
ALTER FUNCTION public.revoke_api_key(uuid) SET jit TO 'off';
ALTER FUNCTION public.score_nodes(text,real,text,text,double precision,double precision,numeric,boolean,integer,text) SET jit TO 'off';
ALTER FUNCTION public.set_tunnel(uuid,boolean) SET jit TO 'off';
ALTER FUNCTION public.sweep(interval) SET jit TO 'off';
ALTER FUNCTION public.tunnel_route(uuid) SET jit TO 'off';
ALTER FUNCTION private.challenge_key_id() SET jit TO 'off';
ALTER FUNCTION private.send_map_summary() SET jit TO 'off';
