package kafkaintake_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/client/internal/examplehipq"
	"github.com/hipq/hipq/client/kafkaintake"
)

func TestMain(m *testing.M) { examplehipq.Main(m) }

func ExampleProducer_Enqueue() {
	ctx := context.Background()
	cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(os.Getenv("HIPQ_EXAMPLE_BROKERS"), ",")...))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	p := kafkaintake.New(cl, os.Getenv("HIPQ_EXAMPLE_INTAKE_TOPIC"))
	job := client.Job{Type: "invoice.ship", Key: "shp_kafka", Data: json.RawMessage(`{"order": 44}`)}
	if err := p.Enqueue(ctx, job, nil); err != nil {
		fmt.Println(err)
		return
	}
	// The brokers have it; hipq has not necessarily read it yet. client.Get
	// or client.Wait tell what became of it.
	fmt.Println("acknowledged by Kafka")
	// Output: acknowledged by Kafka
}

// A request/reply round trip over Kafka: the job's outcome comes back on a
// topic of the caller's (hipq's events.allowed_reply_to allows it).
func ExampleCaller_Call() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	brokers := kgo.SeedBrokers(strings.Split(os.Getenv("HIPQ_EXAMPLE_BROKERS"), ",")...)
	cl, err := kgo.NewClient(brokers)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	p := kafkaintake.New(cl, os.Getenv("HIPQ_EXAMPLE_INTAKE_TOPIC"))
	caller, err := kafkaintake.NewCaller(ctx, p, os.Getenv("HIPQ_EXAMPLE_REPLY_TOPIC"), brokers)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer caller.Close()
	out, err := caller.Call(ctx, client.Job{Type: "invoice.quote", Key: "quote_1", Data: json.RawMessage(`{"order": 45}`)})
	if err != nil {
		fmt.Println(err) // ctx ended first: the job goes on in hipq
		return
	}
	fmt.Println(out.Outcome, string(out.Result))
	// Output: succeeded {"echo": {"order": 45}, "status": "succeeded"}
}
