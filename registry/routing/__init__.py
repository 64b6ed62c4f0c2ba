"""Routes: what an entry is made of (``route_specs``), the route table that says which chain
serves each route (``routes``), canary splits (``variants``), each version's record
(``records``), rollouts and their gates."""
