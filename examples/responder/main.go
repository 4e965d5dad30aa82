// Command responder is a tiny downstream service for trying hipq: it reads
// requests from one topic and answers each on another, copying the hipq-*
// headers so hipq's default matcher finds the job.
//
//	BROKERS=localhost:9092 REQUESTS=invoice.requests REPLIES=invoice.responses responder
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/twmb/franz-go/pkg/kgo"
)

func main() {
	brokers := strings.Split(env("BROKERS", "localhost:9092"), ",")
	requests, replies := env("REQUESTS", "invoice.requests"), env("REPLIES", "invoice.responses")
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumerGroup("example-responder"), kgo.ConsumeTopics(requests))
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log.Printf("answering %s on %s", requests, replies)
	for ctx.Err() == nil {
		fetches := cl.PollFetches(ctx)
		fetches.EachRecord(func(r *kgo.Record) {
			var hs []kgo.RecordHeader
			for _, h := range r.Headers {
				if strings.HasPrefix(h.Key, "hipq-") {
					hs = append(hs, h)
				}
			}
			value := fmt.Sprintf(`{"status":"succeeded","echo":%s}`, r.Value)
			cl.Produce(ctx, &kgo.Record{Topic: replies, Key: r.Key, Value: []byte(value), Headers: hs}, func(_ *kgo.Record, err error) {
				if err != nil {
					log.Printf("reply for %s: %v", r.Key, err)
				}
			})
		})
	}
}

func env(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
