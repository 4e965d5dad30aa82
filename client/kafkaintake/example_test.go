package kafkaintake_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

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
