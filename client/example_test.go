package client_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/hipq/hipq/client"
	"github.com/hipq/hipq/client/internal/examplehipq"
)

func TestMain(m *testing.M) { examplehipq.Main(m) }

func ExampleClient_Enqueue() {
	ctx := context.Background()
	c := client.New(os.Getenv("HIPQ_EXAMPLE_API_URL"), client.WithToken(os.Getenv("HIPQ_EXAMPLE_API_TOKEN")))
	job := client.Job{Type: "invoice.ship", Key: "shp_enqueue", Data: json.RawMessage(`{"order": 42}`)}
	row, created, err := c.Enqueue(ctx, job)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(created, row.State)
	// The same request again is not a second job.
	_, created, _ = c.Enqueue(ctx, job)
	fmt.Println(created)
	// Other data for a key whose job is not final is a conflict.
	job.Data = json.RawMessage(`{"order": 43}`)
	_, _, err = c.Enqueue(ctx, job)
	fmt.Println(errors.Is(err, client.ErrConflict))
	// Output:
	// true initial
	// false
	// true
}

func ExampleClient_Wait() {
	ctx := context.Background()
	c := client.New(os.Getenv("HIPQ_EXAMPLE_API_URL"), client.WithToken(os.Getenv("HIPQ_EXAMPLE_API_TOKEN")))
	row, _, err := c.Enqueue(ctx, client.Job{Type: "invoice.ship", Key: "shp_wait"})
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() { _, _ = c.Cancel(ctx, "invoice.ship", "shp_wait") }() // the job ends elsewhere
	final, err := c.Wait(ctx, row.Ref())                             // returns as soon as it is final
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(final.State, *final.Outcome)
	// Output: final cancelled
}

func ExampleClient_List() {
	ctx := context.Background()
	c := client.New(os.Getenv("HIPQ_EXAMPLE_API_URL"), client.WithToken(os.Getenv("HIPQ_EXAMPLE_API_TOKEN")))
	for _, key := range []string{"shp_list_1", "shp_list_2", "shp_list_3"} {
		if _, _, err := c.Enqueue(ctx, client.Job{Type: "invoice.list", Key: key}); err != nil {
			fmt.Println(err)
			return
		}
	}
	for job, err := range c.List(ctx, client.ListOptions{Type: "invoice.list", PageSize: 2}) {
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(job.Key)
	}
	// Output:
	// shp_list_3
	// shp_list_2
	// shp_list_1
}

func ExampleJob_IntakeJSON() {
	prio := 10
	b, _ := client.Job{Type: "invoice.ship", Key: "shp_123", Data: json.RawMessage(`{"order":42}`), Priority: &prio}.IntakeJSON()
	fmt.Println(string(b))
	// Output: {"job_type":"invoice.ship","job_key":"shp_123","job_data":{"order":42},"priority":10}
}
