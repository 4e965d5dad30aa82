package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/hipq/hipq/internal/certtest"
	"github.com/hipq/hipq/internal/kafkatest"
	"github.com/hipq/hipq/internal/localpg"
	"github.com/hipq/hipq/internal/testutil"
)

// hipq against a PostgreSQL that lets TCP connections in over TLS only
// (ssl=on, hostssl), each with a client certificate naming its user:
// database.url with sslmode=verify-full, sslrootcert, sslcert and sslkey
// runs the whole loop, its migrations included. Without TLS, with a CA
// that did not sign the server's certificate, or without a client
// certificate, a connection is refused.
func TestPostgresOverTLS(t *testing.T) {
	t.Parallel()
	if os.Getenv("HIPQ_TEST_DATABASE_URL") != "" || os.Getenv("HIPQ_TEST_DOCKER") == "1" {
		t.Skip("a PostgreSQL with TLS is started from the local server binaries, not the test server named by the environment")
	}
	ca, clientCA, rogue := certtest.NewCA(t, "postgres"), certtest.NewCA(t, "clients"), certtest.NewCA(t, "rogue")
	server, client := ca.Server(t, "postgres", "127.0.0.1"), clientCA.Client(t, "hipq")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg, err := localpg.Start(ctx, localpg.Options{TLS: &localpg.TLS{CertFile: server.CertFile, KeyFile: server.KeyFile, ClientCAFile: clientCA.File}})
	if err != nil {
		t.Fatalf("start a PostgreSQL with TLS: %v", err)
	}
	t.Cleanup(pg.Stop)
	if _, err := pg.CreateDatabase(ctx, "hipq_tls", ""); err != nil {
		t.Fatal(err)
	}
	tcp := fmt.Sprintf("host=127.0.0.1 port=%d user=hipq dbname=hipq_tls", pg.Port)
	for _, c := range []struct{ name, url, want string }{
		{"without TLS", tcp + " sslmode=disable", "no pg_hba.conf entry"},
		{"a server certificate no trusted CA signed", tcp + " sslmode=verify-full sslrootcert=" + rogue.File +
			" sslcert=" + client.CertFile + " sslkey=" + client.KeyFile, "certificate signed by unknown authority"},
		{"without a client certificate", tcp + " sslmode=verify-full sslrootcert=" + ca.File, "requires a valid client certificate"},
	} {
		conn, err := pgx.Connect(ctx, c.url)
		if err == nil {
			conn.Close(ctx)
			t.Errorf("%s: connected; want it refused", c.name)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want it to say %q", c.name, err, c.want)
		}
	}
	e := &env{t: t, kafka: kafkatest.New(t), dbURL: tcp + " sslmode=verify-full sslrootcert=" + ca.File +
		" sslcert=" + client.CertFile + " sslkey=" + client.KeyFile}
	var names []string
	for _, tp := range e2eTopics {
		names = append(names, e.kafka.Topic(tp))
	}
	e.kafka.CreateTopics(2, names...)
	a := e.start(e.config(e2eConfig))
	var ssl bool
	if err := a.st.Pool().QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil || !ssl {
		t.Fatalf("hipq's connection uses TLS: %v %v", ssl, err)
	}
	rctx, rcancel := context.WithCancel(context.Background())
	defer rcancel()
	e.respond(rctx, "requests", "replies", func(string, int) (string, bool) { return "succeeded", true })
	e.produce("jobs", jobReq("a"), jobReq("b"))
	testutil.Eventually(t, 30*time.Second, func() (bool, string) {
		n := e.countJobs(a, "outcome = 'succeeded'")
		return n == 2, fmt.Sprintf("%d succeeded", n)
	}, "the jobs to succeed over TLS to PostgreSQL")
}
