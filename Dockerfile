# Builds hipq (or, with --build-arg PKG=./examples/responder, the example
# responder) into a small static image.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
# The producers' client is a module of its own, replaced by the local copy.
COPY client/go.mod client/go.sum* client/
RUN go mod download
COPY . .
ARG PKG=./cmd/hipq
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/app ${PKG}

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/app /usr/local/bin/app
ENTRYPOINT ["/usr/local/bin/app"]
