"""What a node's slots are held by, as tests read it. A lease's slots count in nodes.inflight (so no
claim can overbook them), and a job served from a lease holds no slot of its own: the slots held by
jobs placed in SQL are a node's inflight less what leases hold."""

JOB_SLOTS = (
    "(n.inflight - coalesce((select sum(l.slots) from private.slot_leases l where l.node_id = n.id), 0))::int"
)
