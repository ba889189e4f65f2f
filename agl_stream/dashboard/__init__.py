"""`agl-stream dashboard`: a web page over the read model, through a JSON API that an OpenAPI
document describes, with live updates woken by the projector's commits."""
