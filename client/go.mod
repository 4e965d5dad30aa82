module github.com/hipq/hipq/client

go 1.26.0
