"""The HTTP edge: routes (the SDK's and the RestClient's), request bodies, the protobuf codec,
keys and access, the JWT exchange, and starting uvicorn. Only this folder knows HTTP."""
