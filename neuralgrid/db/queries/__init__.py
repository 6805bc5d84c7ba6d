"""Every statement the platform runs, named once, with the shape of its rows, by domain:

- jobs.py: placing a job on a node, moving it, ending it (the matcher's calls);
- models.py: the catalog's models and the models nodes hold;
- keys.py: API keys, and what a key used;
- nodes.py: agents registering and heartbeating, the fleet operators load;
- gateways.py: gateways' liveness, tunnels, readiness, the sweep, the Realtime feed's presence;
- pages.py: what the web pages and /metrics read;
- verification.py: challenges of the models nodes claim, and their outcomes.

The rules live in SQL functions (supabase/migrations/); these are the calls to them and the few
plain reads the pages and the CLI show. `Store` (db/store.py) runs them. Callers read them all from
here (`from neuralgrid.db import queries as q`; `q.PLACE_JOB`), as asyncio's package re-exports its
modules' `__all__`. Two parts keep their own SQL because it is about Postgres itself rather than the
platform's data: the migration runner (db/migrate.py) and the Realtime server (realtime/sql.py).
"""

from neuralgrid.db.queries.dispatch import *  # noqa: F403
from neuralgrid.db.queries.gateways import *  # noqa: F403
from neuralgrid.db.queries.jobs import *  # noqa: F403
from neuralgrid.db.queries.keys import *  # noqa: F403
from neuralgrid.db.queries.models import *  # noqa: F403
from neuralgrid.db.queries.nodes import *  # noqa: F403
from neuralgrid.db.queries.pages import *  # noqa: F403
from neuralgrid.db.queries.query import *  # noqa: F403
from neuralgrid.db.queries.verification import *  # noqa: F403
