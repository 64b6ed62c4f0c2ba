"""HTTP as every HTTP front end speaks it: the middleware (request ids, errors as JSON),
access rules, request bodies within their bounds, compression, connections and their
timeouts, Server-Sent Events, JSON in and out."""
